"""The deployment files, checked statically: docker-compose.yml against the Compose
Specification schema, Kubernetes manifests against Kubernetes schemas, and every container
command through the real `vmesh` CLI parser."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from vmesh.services.cli import build_parser
from vmesh.services.common.grpc_server import LIVENESS

ROOT = Path(__file__).resolve().parents[2]
VMESH_SERVICES = ("worker", "detokenizer", "scheduler", "frontend")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def compose_schema(tmp_path_factory) -> dict:
    """The Compose Specification JSON schema, as shipped inside docker-compose's own wheel."""
    target = tmp_path_factory.mktemp("compose")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "docker-compose==1.29.2",
                    "-d", str(target)], check=True, timeout=120)
    wheel = next(target.glob("docker_compose-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        return json.loads(zf.read("compose/config/compose_spec.json"))


def test_compose_matches_the_compose_specification(compose, compose_schema):
    import jsonschema

    jsonschema.validate(compose, compose_schema)


def parse_cli(argv: list[str]):
    """The real parser; argparse exits on an unknown flag, which fails the test."""
    return build_parser().parse_args(argv)


def env_flags() -> set[str]:
    """Every VMESH_<FLAG> variable some subcommand reads."""
    parser = build_parser()
    subcommands = parser._subparsers._group_actions[0].choices.values()
    return {"VMESH_" + option.lstrip("-").upper().replace("-", "_")
            for sub in [parser, *subcommands] for action in sub._actions for option in action.option_strings}


def test_compose_commands_and_environment_parse(compose):
    known_env = env_flags()
    for name in VMESH_SERVICES:
        service = compose["services"][name]
        args = parse_cli(service["command"])
        assert args.command == name
        for key in service["environment"]:
            assert not key.startswith("VMESH_") or key in known_env, f"{name}: unknown setting {key}"
        environment = {**service["environment"]}
        health = service["healthcheck"]["test"]
        assert parse_cli(health[2:]).command == "health"
        assert health[3] == f"127.0.0.1:{environment['VMESH_HEALTH_PORT']}"  # plaintext, health only
        # mutual TLS: this role's certificate from the certs volume, which the certs job fills once
        assert environment["VMESH_TLS_CERT"] == f"/var/lib/vmesh/certs/{name}.crt"
        assert environment["VMESH_TLS_KEY"] == f"/var/lib/vmesh/certs/{name}.key"
        assert environment["VMESH_TLS_CA"] == "/var/lib/vmesh/certs/ca.crt"
        assert "certs:/var/lib/vmesh/certs:ro" in service["volumes"]
        assert args.metrics_port == 9400
    assert compose["services"]["detokenizer"]["deploy"]["replicas"] == 2
    certs = compose["services"]["certs"]
    assert parse_cli(certs["command"]).if_missing and "certs" in compose["volumes"]
    for name in ("worker", "detokenizer"):
        assert compose["services"][name]["depends_on"]["certs"]["condition"] == "service_completed_successfully"
    assert compose["services"]["scheduler"]["depends_on"]["worker"]["condition"] == "service_healthy"


def test_prometheus_scrapes_every_service(compose):
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    for name in VMESH_SERVICES:
        job = jobs[f"vmesh-{name}"]
        targets = [t for sc in job.get("static_configs", []) for t in sc["targets"]]
        targets += [f"{n}:{sd['port']}" for sd in job.get("dns_sd_configs", []) for n in sd["names"]]
        assert targets == [f"{name}:9400"]
        assert name in compose["services"]


def test_grafana_dashboard_covers_the_key_series():
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/vmesh.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    for series in ("time_to_first_token_seconds", "inter_token_latency_seconds", "generation_tokens_total",
                   "kv_cache_usage_perc", "worker_duty_cycle", "num_requests_waiting"):
        assert f"vmesh:{series}" in exprs
    # Under a Kubernetes scrape the job label is the scrape config's, not compose's: no query may rely on it.
    assert "job=" not in exprs
    # Filtered on model_name as vLLM's dashboard is, through a template variable.
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["model_name"]
    selectors = re.findall(r"vmesh:[a-z_]+(\{[^}]*\})?", exprs)
    assert selectors and all('model_name=~"$model_name"' in s for s in selectors)


def k8s_documents() -> list[tuple[Path, dict]]:
    docs = []
    for path in sorted((ROOT / "k8s/base").glob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs += [(path, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


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


# --- Rendered manifests -------------------------------------------------------------------------
# No kustomize binary here: render() reads a kustomization the way kustomize does for the features
# these files use (resources, patches with a target, images) and applies patches with a strategic
# merge reduced to the cases used: maps merge, null deletes a key, lists of named items (containers,
# volumes, env, mounts) merge by name, any other list is replaced.

K8S_SETS = {"base": "k8s/base", "cpu": "k8s/overlays/cpu", "tracing": "k8s/overlays/tracing",
            "keda": "k8s/overlays/keda", "tensor-parallel": "k8s/overlays/tensor-parallel"}
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job")


def strategic_merge(target, patch):
    if isinstance(target, dict) and isinstance(patch, dict):
        merged = dict(target)
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
            elif key in merged:
                merged[key] = strategic_merge(merged[key], value)
            else:
                merged[key] = value
        return merged
    if (isinstance(target, list) and isinstance(patch, list) and patch
            and all(isinstance(i, dict) and "name" in i for i in target + patch)):
        merged = list(target)
        for item in patch:
            at = next((n for n, old in enumerate(merged) if old["name"] == item["name"]), None)
            if at is None:
                merged.append(item)
            else:
                merged[at] = strategic_merge(merged[at], item)
        return merged
    return patch


def split_image(image: str) -> tuple[str, str | None]:
    name, _, _digest = image.partition("@")
    head, sep, tag = name.rpartition(":")
    return (head, tag) if sep and "/" not in tag else (name, None)


def pod_templates(docs: list[dict]):
    for doc in docs:
        if doc["kind"] in WORKLOAD_KINDS:
            yield doc, doc["spec"]["template"]["spec"]


def all_containers(pod: dict) -> list[dict]:
    return pod.get("initContainers", []) + pod["containers"]


def render(directory: Path) -> list[dict]:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    docs: list[dict] = []
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        docs += render(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    for patch in kustomization.get("patches", []):
        body, target = yaml.safe_load((directory / patch["path"]).read_text()), patch["target"]
        hits = [n for n, d in enumerate(docs)
                if d["kind"] == target["kind"] and d["metadata"]["name"] == target["name"]]
        assert len(hits) == 1, f"{directory}: patch {patch['path']} matches {len(hits)} documents"
        docs[hits[0]] = strategic_merge(docs[hits[0]], body)
    for image in kustomization.get("images", []):
        for _doc, pod in pod_templates(docs):
            for container in all_containers(pod):
                name, tag = split_image(container["image"])
                if name == image["name"]:
                    tag = image.get("newTag", tag)
                    container["image"] = image.get("newName", name) + (f":{tag}" if tag else "")
    return docs


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: render(ROOT / path) for name, path in K8S_SETS.items()}


def dockerfile_env() -> dict[str, str]:
    """The image's ENV, from the Dockerfile (KEY=VALUE forms, continued lines joined)."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    env: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            for pair in line[4:].split():
                key, _, value = pair.partition("=")
                env[key] = value
    return env


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def vmesh_role(container: dict) -> str | None:
    return container["args"][0] if split_image(container["image"])[0].endswith("vmesh") else None


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


def test_k8s_every_path_the_image_writes_is_a_writable_volume(rendered):
    """With a read-only root filesystem, each directory a service writes to (from the image's
    ENV: HOME, TRITON_CACHE_DIR, VMESH_CACHE_DIR/kernels for the worker's CPU kernels; /tmp for
    everyone) must be an emptyDir mounted read-write; and the image makes those directories its
    user's, for compose, where the root filesystem stays the image's."""
    env = dockerfile_env()
    writes = {"worker": ["/tmp", env["HOME"], env["TRITON_CACHE_DIR"], env["VMESH_CACHE_DIR"] + "/kernels"]}
    for role in ("frontend", "detokenizer", "scheduler"):
        writes[role] = ["/tmp", env["HOME"]]
    dockerfile = (ROOT / "Dockerfile").read_text()
    chowned = {p for line in dockerfile.replace("\\\n", " ").splitlines() if "chown 65532:65532" in line
               for p in line.split("chown 65532:65532", 1)[1].split("&&")[0].split()}
    assert set(writes["worker"]) - {"/tmp"} <= chowned
    assert "USER 65532:65532" in dockerfile
    for name, docs in rendered.items():
        for doc, pod in pod_templates(docs):
            volumes = {v["name"]: v for v in pod.get("volumes", [])}
            for container in all_containers(pod):
                role = vmesh_role(container)
                for path in writes.get(role, ["/tmp"]):
                    mounts = [m for m in container.get("volumeMounts", [])
                              if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")]
                    assert mounts, f"{name}/{doc['metadata']['name']}: nothing writable at {path}"
                    mount = max(mounts, key=lambda m: len(m["mountPath"]))  # the one that shadows the rest
                    assert "emptyDir" in volumes[mount["name"]] and not mount.get("readOnly"), f"{name}: {path}"


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


def test_compose_shares_a_model_cache_volume_writable_by_the_image_user(compose):
    """The converted-model cache is the named volume `models` at the image's VMESH_CACHE_DIR for
    every service that loads the model; a new volume copies the image's directory and owners, so
    the cache and its kernels directory must be the runtime user's in the image."""
    cache = dockerfile_env()["VMESH_CACHE_DIR"]
    assert "models" in compose["volumes"]
    for name in ("worker", "frontend", "detokenizer"):
        assert f"models:{cache}" in compose["services"][name]["volumes"], name
    dockerfile = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    chowned = {p for line in dockerfile.splitlines() if "chown 65532:65532" in line
               for p in line.split("chown 65532:65532", 1)[1].split("&&")[0].split()}
    assert {cache, f"{cache}/kernels"} <= chowned
    for service in compose["services"].values():
        assert not service.get("image", "x:pinned").endswith(":latest") and ":" in service.get("image", "x:pinned")


def test_image_copies_what_the_package_is_built_from():
    """`pip install .` in the image needs every folder pyproject maps into the package, and
    nothing else of the checkout (benchmarks and tests stay out of the image)."""
    import tomllib

    setuptools_config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    needed = {*setuptools_config["package-dir"].values(), "vmesh", "pyproject.toml", "README.md"}
    copied = set()
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            copied.update(line.split()[1:-1])
    assert needed == copied
    assert {p.split(".")[0] for p in setuptools_config["packages"]} == {"vmesh"}
    dockerfile = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    assert 'pip install ".${VMESH_EXTRAS}"' in dockerfile
    assert "rm -rf services kernels vmesh" in dockerfile  # the launcher's `-m vmesh` must find the install


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
