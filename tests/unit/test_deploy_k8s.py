"""The Kubernetes manifests, checked statically: base and every overlay, rendered, against the
Kubernetes schemas; container commands through the real `vmesh` CLI parser; probes, network
policies, pod security, disruption budgets, tracing, autoscaling and tensor parallelism."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.support.checkout import ROOT
from tests.support.deployment import (
    VMESH_SERVICES,
    all_containers,
    by_kind,
    k8s_documents,
    parse_cli,
    pod_templates,
    selects,
    split_image,
    vmesh_role,
    workload_templates,
)
from vmesh.services.common.grpc_server import LIVENESS


@pytest.mark.parametrize("version", ["1.30.0", "1.33.0"])
def test_k8s_manifests_match_kubernetes_schemas(version):
    import kubernetes_validate

    kinds = set()
    for _path, doc in k8s_documents():
        kubernetes_validate.validate(doc, version, strict=True)
        kinds.add(doc["kind"])
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "ConfigMap",
            "NetworkPolicy"} <= kinds


def health_port(container: dict, config: dict[str, str]) -> int:
    """The plaintext health-only port a container's service binds: its --health-port, else the ConfigMap's."""
    port = parse_cli(container["args"]).health_port
    return int(port if port is not None else config["VMESH_HEALTH_PORT"])


def test_k8s_container_args_parse_and_probes_are_grpc(rendered):
    config = yaml.safe_load((ROOT / "k8s/base/configmap.yaml").read_text())["data"]
    assert config["VMESH_TLS_CA"] == "/etc/vmesh/certs/ca.crt"
    resources = yaml.safe_load((ROOT / "k8s/base/kustomization.yaml").read_text())["resources"]
    assert sorted(resources) == sorted(p.name for p in (ROOT / "k8s/base").glob("*.yaml")
                                       if p.name != "kustomization.yaml")
    for name, docs in rendered.items():
        seen = set()
        for _doc, pod in pod_templates(docs):
            for c in all_containers(pod):
                if not vmesh_role(c):
                    continue
                args = parse_cli(c["args"])
                seen.add(args.command)
                env = {e["name"]: e for e in c["env"]}
                # mutual TLS: this role's certificate, from the vmesh-certs Secret, and nothing else of it
                assert env["VMESH_TLS_CERT"]["value"] == f"/etc/vmesh/certs/{args.command}.crt"
                assert env["VMESH_TLS_KEY"]["value"] == f"/etc/vmesh/certs/{args.command}.key"
                mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/etc/vmesh/certs")
                volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
                assert volume["secret"]["secretName"] == "vmesh-certs"
                assert {i["key"] for i in volume["secret"]["items"]} == {"ca.crt", f"{args.command}.crt",
                                                                         f"{args.command}.key"}
                # gRPC probes present no certificate: they use the plaintext health-only port
                for probe in ("readinessProbe", "livenessProbe"):
                    assert c[probe]["grpc"]["port"] == health_port(c, config), f"{name}: {c['name']}"
                # Readiness follows the overall status (NOT_SERVING while recovering a worker or
                # draining); liveness a name that stays SERVING, or the kubelet kills a recovery.
                assert "service" not in c["readinessProbe"]["grpc"]
                assert c["livenessProbe"]["grpc"]["service"] == LIVENESS
                if args.command == "worker":
                    gpu = c["resources"]["limits"].get("nvidia.com/gpu")
                    assert gpu == ("1" if args.device == "cuda" else None), f"{name}: {args.device} worker, GPU {gpu}"
                    startup = c["startupProbe"]
                    assert startup["failureThreshold"] * startup["periodSeconds"] >= 600
        assert seen == set(VMESH_SERVICES), name
    cpu_workers = [c for _d, pod in pod_templates(rendered["cpu"]) for c in all_containers(pod)
                   if vmesh_role(c) == "worker"]
    assert cpu_workers and all(parse_cli(c["args"]).device == "cpu" for c in cpu_workers)


def test_k8s_network_policies_admit_only_each_port_s_callers():
    """Each internal gRPC port admits only the pods of the role that calls it (as guards.CALLERS
    does for certificates); the frontend's public ports are open."""
    policies = {d["metadata"]["name"]: d for _p, d in k8s_documents() if d["kind"] == "NetworkPolicy"}
    callers = {"vmesh-group": ({"vmesh-frontend"}, 50052, {9400, 8081, 9401, 8082}),
               "vmesh-detokenizer": ({"vmesh-group", "vmesh-frontend"}, 50054, {9400, 8081})}
    for name, (expected, port, metrics_and_health) in callers.items():
        rules = policies[name]["spec"]["ingress"]
        grpc_rules = [r for r in rules if {"port": port} in r.get("ports", [])]
        assert len(grpc_rules) == 1 and grpc_rules[0]["from"], name
        allowed = {f["podSelector"]["matchLabels"]["app.kubernetes.io/name"] for f in grpc_rules[0]["from"]}
        assert allowed == expected, name
        open_ports = {p["port"] for r in rules if "from" not in r for p in r["ports"]}
        assert open_ports == metrics_and_health, name
    # The group's worker is reached over its pod's loopback only: no rule admits anyone to it.
    assert not any({"port": 50053} in r.get("ports", []) for r in policies["vmesh-group"]["spec"]["ingress"])
    public = policies["vmesh-frontend"]["spec"]["ingress"]
    assert {p["port"] for r in public for p in r["ports"]} >= {50051, 8000}


CUSTOM_RESOURCES = {"keda.sh/v1alpha1": "ScaledObject", "leaderworkerset.x-k8s.io/v1": "LeaderWorkerSet"}


@pytest.mark.parametrize("version", ["1.30.0", "1.33.0"])
def test_k8s_rendered_sets_match_kubernetes_schemas(rendered, version):
    """Base and every overlay, rendered, against the Kubernetes schemas. kubernetes-validate has
    no schema for the custom resources: their pod templates are validated as Pods and the
    ScaledObject's autoscaling behaviour as an HPA's, their own fields by their tests."""
    import kubernetes_validate

    for name, docs in rendered.items():
        for doc in docs:
            if doc["apiVersion"] in CUSTOM_RESOURCES:
                assert doc["kind"] == CUSTOM_RESOURCES[doc["apiVersion"]], f"{name}: {doc['kind']}"
                for template in ([t for _d, t in workload_templates([doc])]):
                    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "template", **template["metadata"]},
                           "spec": template["spec"]}
                    kubernetes_validate.validate(pod, version, strict=True)
                if doc["kind"] == "ScaledObject":
                    spec = doc["spec"]
                    hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
                           "metadata": {"name": doc["metadata"]["name"]},
                           "spec": {"scaleTargetRef": spec["scaleTargetRef"], "minReplicas": spec["minReplicaCount"],
                                    "maxReplicas": spec["maxReplicaCount"],
                                    **spec["advanced"]["horizontalPodAutoscalerConfig"]}}
                    kubernetes_validate.validate(hpa, version, strict=True)
                continue
            kubernetes_validate.validate(doc, version, strict=True)


def test_k8s_images_are_pinned_set_once_and_match_the_worker_device(rendered):
    """No :latest and IfNotPresent everywhere; the manifests all say `image: vmesh` and the
    kustomizations name the image: the base the CUDA build (its workers run --device cuda), the
    CPU overlay the CPU build, both tagged with the package version."""
    version = next(line.split('"')[1] for line in (ROOT / "pyproject.toml").read_text().splitlines()
                   if line.startswith("version"))
    for _path, doc in k8s_documents():
        for _doc, pod in pod_templates([doc]):
            assert {c["image"] for c in all_containers(pod)} == {"vmesh"}  # named only in kustomization.yaml
    base_images = yaml.safe_load((ROOT / "k8s/base/kustomization.yaml").read_text())["images"]
    cpu_images = yaml.safe_load((ROOT / "k8s/overlays/cpu/kustomization.yaml").read_text())["images"]
    assert [i["name"] for i in base_images] == ["vmesh"]
    assert [i["name"] for i in cpu_images] == [base_images[0]["newName"]]  # the image as the base emits it
    tags = {}
    for name, docs in rendered.items():
        vmesh_images = set()
        for _doc, pod in pod_templates(docs):
            for container in all_containers(pod):
                _image_name, tag = split_image(container["image"])
                assert tag and tag != "latest", f"{name}: {container['image']} is not pinned"
                assert container["imagePullPolicy"] == "IfNotPresent", f"{name}: {container['name']}"
                if vmesh_role(container):
                    vmesh_images.add(container["image"])
                    if vmesh_role(container) == "worker":
                        device = parse_cli(container["args"]).device
        assert len(vmesh_images) == 1, f"{name}: {vmesh_images}"  # one image for every service
        tag = split_image(vmesh_images.pop())[1]
        assert tag == (f"{version}-cuda" if device == "cuda" else version), f"{name}: {tag} for --device {device}"
        tags[name] = tag
    assert tags["base"] != tags["cpu"]


RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}


def test_k8s_pods_meet_the_restricted_pod_security_standard(rendered):
    """The fields of the "restricted" Pod Security Standard, on every pod and container of every
    rendered set (the collector's included), plus a read-only root filesystem."""
    for name, docs in rendered.items():
        for doc, pod in pod_templates(docs):
            where = f"{name}/{doc['kind']}/{doc['metadata']['name']}"
            context = pod["securityContext"]
            assert context["runAsNonRoot"] is True, where
            assert context["runAsUser"] == context["runAsGroup"] == context["fsGroup"] == 65532, where
            assert context["seccompProfile"] == {"type": "RuntimeDefault"}, where
            assert not any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")), where
            for volume in pod.get("volumes", []):
                assert set(volume) - {"name"} <= RESTRICTED_VOLUMES, f"{where}: volume {volume['name']}"
            for container in all_containers(pod):
                sc = container["securityContext"]
                assert sc["allowPrivilegeEscalation"] is False, where
                assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add"), where
                assert sc["readOnlyRootFilesystem"] is True, where
                assert not sc.get("privileged") and sc.get("runAsUser", 65532) != 0, where
                assert sc.get("seccompProfile", {"type": "RuntimeDefault"})["type"] == "RuntimeDefault", where
                assert not any("hostPort" in p for p in container.get("ports", [])), where


def replicas_floor(docs: list[dict], workload: dict) -> int:
    """The fewest replicas a workload runs: spec.replicas, or the minimum of its autoscaler."""
    floors = [workload["spec"].get("replicas", 1)]
    for scaler in docs:
        ref = scaler["spec"].get("scaleTargetRef", {}) if scaler["kind"] in ("HorizontalPodAutoscaler",
                                                                            "ScaledObject") else {}
        if ref.get("kind") == workload["kind"] and ref.get("name") == workload["metadata"]["name"]:
            floors.append(scaler["spec"].get("minReplicas", scaler["spec"].get("minReplicaCount", 1)))
    return min(floors)


def test_k8s_disruption_budgets_allow_a_drain(rendered):
    """Each PodDisruptionBudget covers exactly one workload and, at that workload's fewest
    replicas, still lets one pod be evicted (maxUnavailable: 0, or minAvailable equal to the
    replica count, would block `kubectl drain` forever)."""
    for name, docs in rendered.items():
        budgets = by_kind(docs, "PodDisruptionBudget")
        assert {"vmesh-group", "vmesh-frontend", "vmesh-detokenizer"} <= set(budgets), name
        for budget in budgets.values():
            selector = budget["spec"]["selector"]["matchLabels"]
            workloads = list({id(d): d for d, template in workload_templates(docs) if selects(selector, template)}
                             .values())
            assert len(workloads) == 1, f"{name}: {budget['metadata']['name']} selects {len(workloads)} workloads"
            replicas = replicas_floor(docs, workloads[0])
            spec = budget["spec"]
            assert not isinstance(spec.get("maxUnavailable", spec.get("minAvailable")), str)  # no percentages here
            allowed = spec["maxUnavailable"] if "maxUnavailable" in spec else replicas - spec["minAvailable"]
            assert allowed >= 1, f"{name}: {budget['metadata']['name']} allows no eviction at {replicas} replicas"
            assert "minAvailable" not in spec or spec["minAvailable"] >= 1  # and keeps one serving


def otel_endpoints(docs: list[dict]) -> list[str]:
    found = []
    for doc in docs:
        if doc["kind"] == "ConfigMap":
            found += [v for k, v in doc.get("data", {}).items() if k.startswith("OTEL_") and k.endswith("ENDPOINT")]
    for _doc, pod in pod_templates(docs):
        for container in all_containers(pod):
            found += [e["value"] for e in container.get("env", [])
                      if e["name"].startswith("OTEL_") and e["name"].endswith("ENDPOINT") and "value" in e]
    return found


def test_k8s_otel_endpoints_resolve_to_a_service_in_the_same_set(rendered, compose):
    """Every OTLP endpoint a rendered set configures names a Service (and port) of that same set:
    none in base, cpu and keda (tracing off), the collector in the tracing overlay, whose config
    receives OTLP gRPC there and prints spans with the debug exporter. Compose: Jaeger's OTLP."""
    from urllib.parse import urlsplit

    for name, docs in rendered.items():
        services = by_kind(docs, "Service")
        endpoints = otel_endpoints(docs)
        assert bool(endpoints) == (name == "tracing"), f"{name}: {endpoints}"
        for endpoint in endpoints:
            url = urlsplit(endpoint)
            service = services.get(url.hostname.split(".")[0])
            assert service, f"{name}: {endpoint} names no Service of this set"
            assert url.port in {p["port"] for p in service["spec"]["ports"]}, f"{name}: {endpoint}"
            backends = [d for d, template in workload_templates(docs) if selects(service["spec"]["selector"], template)]
            assert backends, f"{name}: Service {service['metadata']['name']} selects no pods"
    docs = rendered["tracing"]
    collector = by_kind(docs, "Deployment")["otel-collector"]["spec"]["template"]["spec"]
    container = collector["containers"][0]
    config_path = Path(container["args"][0].removeprefix("--config="))
    mount = next(m for m in container["volumeMounts"] if Path(m["mountPath"]) == config_path.parent)
    volume = next(v for v in collector["volumes"] if v["name"] == mount["name"])
    config = yaml.safe_load(by_kind(docs, "ConfigMap")[volume["configMap"]["name"]]["data"][config_path.name])
    assert config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"] == "0.0.0.0:4317"
    for signal in ("traces", "metrics"):  # the services send both once an endpoint is set
        pipeline = config["service"]["pipelines"][signal]
        assert pipeline["receivers"] == ["otlp"] and "debug" in pipeline["exporters"]
    assert "debug" in config["exporters"]
    policy = by_kind(docs, "NetworkPolicy")["otel-collector"]["spec"]["ingress"][0]
    allowed = policy["from"][0]["podSelector"]["matchExpressions"][0]["values"]
    vmesh_pods = {template["metadata"]["labels"]["app.kubernetes.io/name"] for _d, template in workload_templates(docs)
                  if any(vmesh_role(c) for c in all_containers(template["spec"]))}
    assert set(allowed) == vmesh_pods and policy["ports"] == [{"port": 4317}]
    endpoint = urlsplit(compose["x-vmesh"]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"])
    assert endpoint.hostname in compose["services"] and endpoint.port == 4317
    assert compose["services"][endpoint.hostname]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    assert compose["x-vmesh"]["environment"]["OTEL_METRICS_EXPORTER"] == "none"  # Jaeger has no metrics
