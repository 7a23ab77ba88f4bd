"""The Kubernetes manifests, checked statically: base and every overlay, rendered, against the
Kubernetes schemas; container commands through the real `vmesh` CLI parser; probes, network
policies, pod security, disruption budgets, tracing, autoscaling and tensor parallelism."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from tests.support.checkout import ROOT
from tests.support.deployment import (
    VMESH_SERVICES,
    all_containers,
    by_kind,
    env_flags,
    k8s_documents,
    parse_cli,
    pod_templates,
    split_image,
    vmesh_role,
)
from vmesh.services.common.grpc_server import LIVENESS


@pytest.mark.parametrize("version", ["1.30.0", "1.33.0"])
def test_k8s_manifests_match_kubernetes_schemas(version):
    import kubernetes_validate

    kinds = set()
    for _path, doc in k8s_documents():
        kubernetes_validate.validate(doc, version, strict=True)
        kinds.add(doc["kind"])
    assert {"Deployment", "StatefulSet", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget",
            "ConfigMap", "NetworkPolicy"} <= kinds


def test_k8s_container_args_parse_and_probes_are_grpc():
    config = yaml.safe_load((ROOT / "k8s/base/configmap.yaml").read_text())["data"]
    assert config["VMESH_TLS_CA"] == "/etc/vmesh/certs/ca.crt"
    resources = yaml.safe_load((ROOT / "k8s/base/kustomization.yaml").read_text())["resources"]
    assert sorted(resources) == sorted(p.name for p in (ROOT / "k8s/base").glob("*.yaml")
                                       if p.name != "kustomization.yaml")
    seen = set()
    for _path, doc in k8s_documents():
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for container in doc["spec"]["template"]["spec"]["containers"]:
            args = parse_cli(container["args"])
            seen.add(args.command)
            env = {e["name"]: e["value"] for e in container["env"]}
            # mutual TLS: this role's certificate, from the vmesh-certs Secret, and nothing else of it
            assert env["VMESH_TLS_CERT"] == f"/etc/vmesh/certs/{args.command}.crt"
            assert env["VMESH_TLS_KEY"] == f"/etc/vmesh/certs/{args.command}.key"
            volume = next(v for v in doc["spec"]["template"]["spec"]["volumes"] if v["name"] == "certs")
            assert volume["secret"]["secretName"] == "vmesh-certs"
            assert {i["key"] for i in volume["secret"]["items"]} == {"ca.crt", f"{args.command}.crt",
                                                                     f"{args.command}.key"}
            assert container["volumeMounts"][0]["mountPath"] == "/etc/vmesh/certs"
            # gRPC probes present no certificate: they use the plaintext health-only port
            for probe in ("readinessProbe", "livenessProbe"):
                assert container[probe]["grpc"]["port"] == int(config["VMESH_HEALTH_PORT"])
            # Readiness follows the overall status (NOT_SERVING while recovering a worker or
            # draining); liveness a name that stays SERVING, or the kubelet kills a recovery.
            assert "service" not in container["readinessProbe"]["grpc"]
            assert container["livenessProbe"]["grpc"]["service"] == LIVENESS
            if args.command == "worker":
                assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
                assert container["startupProbe"]["failureThreshold"] * container["startupProbe"]["periodSeconds"] >= 600
                assert doc["kind"] == "StatefulSet"
    assert seen == set(VMESH_SERVICES)
    overlay = yaml.safe_load((ROOT / "k8s/overlays/cpu/worker-cpu.yaml").read_text())
    worker = overlay["spec"]["template"]["spec"]["containers"][0]
    assert parse_cli(worker["args"]).device == "cpu"
    assert worker["resources"]["limits"]["nvidia.com/gpu"] is None  # removed by the strategic merge


def test_k8s_network_policies_admit_only_each_port_s_callers():
    """Each internal gRPC port admits only the pods of the role that calls it (as guards.CALLERS
    does for certificates); the frontend's public ports are open."""
    policies = {d["metadata"]["name"]: d for _p, d in k8s_documents() if d["kind"] == "NetworkPolicy"}
    callers = {"vmesh-scheduler": ({"vmesh-frontend"}, 50052), "vmesh-worker": ({"vmesh-scheduler"}, 50053),
               "vmesh-detokenizer": ({"vmesh-scheduler", "vmesh-frontend"}, 50054)}
    for name, (expected, port) in callers.items():
        rules = policies[name]["spec"]["ingress"]
        grpc_rules = [r for r in rules if {"port": port} in r.get("ports", [])]
        assert len(grpc_rules) == 1 and grpc_rules[0]["from"], name
        allowed = {f["podSelector"]["matchLabels"]["app.kubernetes.io/name"] for f in grpc_rules[0]["from"]}
        assert allowed == expected, name
        open_ports = {p["port"] for r in rules if "from" not in r for p in r["ports"]}
        assert open_ports == {9400, 8081}, name
    public = policies["vmesh-frontend"]["spec"]["ingress"]
    assert {p["port"] for r in public for p in r["ports"]} >= {50051, 8000}


@pytest.mark.parametrize("version", ["1.30.0", "1.33.0"])
def test_k8s_rendered_sets_match_kubernetes_schemas(rendered, version):
    """Base and every overlay, rendered, against the Kubernetes schemas (custom resources, which
    kubernetes-validate has no schema for, are checked by their own tests)."""
    import kubernetes_validate

    for name, docs in rendered.items():
        for doc in docs:
            if doc["apiVersion"].startswith("keda.sh/"):
                assert name == "keda" and doc["kind"] == "ScaledObject", doc["kind"]
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
        assert {"vmesh-worker", "vmesh-frontend", "vmesh-detokenizer"} <= set(budgets), name
        for budget in budgets.values():
            selector = budget["spec"]["selector"]["matchLabels"]
            workloads = [d for d, _pod in pod_templates(docs)
                         if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
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
            backends = [d for d, _pod in pod_templates(docs)
                        if service["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
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
    assert set(allowed) == {f"vmesh-{s}" for s in VMESH_SERVICES} and policy["ports"] == [{"port": 4317}]
    endpoint = urlsplit(compose["x-vmesh"]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"])
    assert endpoint.hostname in compose["services"] and endpoint.port == 4317
    assert compose["services"][endpoint.hostname]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    assert compose["x-vmesh"]["environment"]["OTEL_METRICS_EXPORTER"] == "none"  # Jaeger has no metrics


def scheduler_gauges() -> set[str]:
    source = (ROOT / "services/scheduler/server.py").read_text()
    return set(re.findall(r'"(vmesh:[a-z_]+)": \("gauge"', source))


def test_keda_scaled_object_scales_the_workers_on_queue_depth(rendered):
    """The ScaledObject (a CRD, so plain asserts): it targets the worker StatefulSet of its set, its
    Prometheus query reads a gauge the scheduler exports, and it never creates a worker that no
    scheduler dials (each new worker needs a scheduler group of its own, which is not wired)."""
    docs = rendered["keda"]
    scaled = by_kind(docs, "ScaledObject")["vmesh-worker"]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    target = spec["scaleTargetRef"]
    assert target["apiVersion"] == "apps/v1" and target["kind"] == "StatefulSet"
    workers = by_kind(docs, "StatefulSet")[target["name"]]
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    [trigger] = spec["triggers"]
    assert trigger["type"] == "prometheus"
    metrics = set(re.findall(r"vmesh:[a-z_]+", trigger["metadata"]["query"]))
    assert metrics == {"vmesh:num_requests_waiting"} and metrics <= scheduler_gauges()
    assert trigger["metadata"]["query"] == "sum(vmesh:num_requests_waiting)"
    assert float(trigger["metadata"]["threshold"]) > 0
    assert trigger["metadata"]["serverAddress"].startswith(("http://", "https://"))
    # Worker pods a scheduler dials: StatefulSet pods are <name>-<ordinal>.<serviceName>.
    dialled = set()
    for _doc, pod in pod_templates(docs):
        for container in pod["containers"]:
            if vmesh_role(container) == "scheduler":
                dialled |= {a.split(".")[0] for a in parse_cli(container["args"]).workers.split(",") if a}
    for ordinal in range(spec["maxReplicaCount"]):
        assert f"{workers['metadata']['name']}-{ordinal}" in dialled, \
            f"maxReplicaCount {spec['maxReplicaCount']} would start worker {ordinal}, which no scheduler dials"


def test_tensor_parallel_overlay_makes_one_group_of_the_worker_pods(rendered):
    """Every rank's settings are the worker's own flags; the ranks are the StatefulSet's ordinals,
    meet at rank 0's pod by a DNS name published before they are Ready, reach each other through
    the network policy, and are all dialled by the scheduler."""
    docs = rendered["tensor-parallel"]
    worker = by_kind(docs, "StatefulSet")["vmesh-worker"]
    container = worker["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    size = int(env["VMESH_TENSOR_PARALLEL_SIZE"]["value"])
    assert worker["spec"]["replicas"] == size and worker["spec"]["podManagementPolicy"] == "Parallel"
    assert env["VMESH_TENSOR_PARALLEL_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.labels['apps.kubernetes.io/pod-index']"
    host, _, port = env["VMESH_TENSOR_PARALLEL_INIT"]["value"].partition(":")
    service = worker["spec"]["serviceName"]
    assert host == f"{worker['metadata']['name']}-0.{service}"
    assert {"name": "rendezvous", "containerPort": int(port)} in container["ports"]
    assert by_kind(docs, "Service")[service]["spec"]["publishNotReadyAddresses"] is True
    args = parse_cli(container["args"])  # the env names are the worker's flags, defaults checked
    for name in ("VMESH_TENSOR_PARALLEL_SIZE", "VMESH_TENSOR_PARALLEL_RANK", "VMESH_TENSOR_PARALLEL_INIT"):
        assert name in env_flags(), name
    assert args.command == "worker"
    scheduler = parse_cli(by_kind(docs, "Deployment")["vmesh-scheduler"]["spec"]["template"]["spec"]
                          ["containers"][0]["args"])
    assert scheduler.workers.split(",") == [f"{worker['metadata']['name']}-{r}.{service}:50053" for r in range(size)]
    ingress = by_kind(docs, "NetworkPolicy")["vmesh-worker"]["spec"]["ingress"]
    peers = [r for r in ingress if r.get("from") == [{"podSelector": {"matchLabels":
                                                                      {"app.kubernetes.io/name": "vmesh-worker"}}}]]
    assert len(peers) == 1 and "ports" not in peers[0]
