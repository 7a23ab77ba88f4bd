"""Worker groups on Kubernetes, on kustomize's own output: the pod that holds a scheduler and its
worker rank, the headless Service the frontends resolve, the drain timings, the autoscaling of
groups (KEDA and an HPA on custom metrics, whose queries must name series the scheduler really
exports) and the LeaderWorkerSet groups of the tensor-parallel overlay."""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from urllib.parse import urlsplit

import pytest
import yaml

from tests.support.checkout import ROOT
from tests.support.deployment import (
    all_containers,
    by_kind,
    container,
    env_flags,
    parse_cli,
    promql_series,
    scheduler_series,
    selects,
    vmesh_role,
    workload_templates,
)
from tests.support.prerequisites import missing
from vmesh.services.common.grpc_server import DRAIN_GRACE_S, STOP_GRACE_S
from vmesh.services.common.runtime.discovery import DEFAULT_REFRESH_INTERVAL_S, DNS_PREFIX

GROUP = "vmesh-group"
SCHEDULERS = "vmesh-scheduler"  # the headless Service of every group's scheduler
SHUTDOWN_S = DRAIN_GRACE_S + STOP_GRACE_S  # the longest a service takes from SIGTERM to exit
AUTOSCALED = ("keda", "hpa-custom-metrics")


@pytest.fixture(scope="module")
def exported() -> set[str]:
    return scheduler_series()


def group_templates(docs: list[dict]) -> list[tuple[dict, dict]]:
    """(workload, template) of every pod that runs a scheduler."""
    return [(d, t) for d, t in workload_templates(docs)
            if any(vmesh_role(c) == "scheduler" for c in all_containers(t["spec"]))]


def port_of(c: dict) -> int:
    return parse_cli(c["args"]).port


def preStop_sleep(c: dict) -> int:
    return c.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)


def refresh_interval(docs: list[dict]) -> float:
    config = by_kind(docs, "ConfigMap")["vmesh-config"]["data"]
    return float(config.get("VMESH_REPLICA_REFRESH_INTERVAL", DEFAULT_REFRESH_INTERVAL_S))


WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"


def as_created(doc: dict, template: dict) -> dict:
    """A pod template with the labels its controller adds: LWS labels a group's leader with
    worker index 0 and the other pods with 1..N-1."""
    if doc["kind"] != "LeaderWorkerSet":
        return template
    index = "0" if template is doc["spec"]["leaderWorkerTemplate"]["leaderTemplate"] else "1"
    metadata = template["metadata"]
    return {**template, "metadata": {**metadata, "labels": {**metadata.get("labels", {}), WORKER_INDEX: index}}}


def test_a_group_pod_holds_a_scheduler_and_its_worker(rendered):
    """In every set, the only pods running a scheduler are the group workload's, and each holds
    its worker rank 0 as a native sidecar (started first, stopped last) on the pod's loopback;
    the two containers' ports do not collide. No worker runs outside a group."""
    for name, docs in rendered.items():
        groups = group_templates(docs)
        assert {d["metadata"]["name"] for d, _t in groups} == {GROUP}, name
        for _doc, template in groups:
            pod = template["spec"]
            worker = container(pod, "worker")
            assert worker in pod["initContainers"] and worker["restartPolicy"] == "Always", name
            assert worker["startupProbe"], name  # the scheduler starts once the model is loaded
            scheduler = container(pod, "scheduler")
            ranks = parse_cli(scheduler["args"]).workers.split(",")
            assert ranks[0] == f"127.0.0.1:{port_of(worker)}", name
            ports = [p["containerPort"] for c in all_containers(pod) for p in c.get("ports", [])]
            assert len(ports) == len(set(ports)), f"{name}: the group's containers share a port: {ports}"
            for c in (worker, scheduler):
                args = parse_cli(c["args"])
                declared = {p["containerPort"] for p in c["ports"]}
                assert {args.port, args.metrics_port} <= declared, f"{name}: {c['name']}"
        standalone = [c for _d, t in workload_templates(docs) if (_d, t) not in groups
                      for c in all_containers(t["spec"]) if vmesh_role(c) == "worker"]
        assert name == "tensor-parallel" or not standalone, f"{name}: a worker outside any group"


def test_frontends_resolve_every_group_through_the_headless_service(rendered):
    """The frontends' --scheduler is a dns:/// name (re-resolved every --replica-refresh-interval,
    so a new group joins) of a headless Service that selects exactly the group pods, on the
    scheduler's port."""
    for name, docs in rendered.items():
        service = by_kind(docs, "Service")[SCHEDULERS]["spec"]
        assert service["clusterIP"] == "None", name  # every group's own address, not one virtual IP
        assert not service.get("publishNotReadyAddresses"), name  # a loading or draining group is left out
        selected = [t for d, t in workload_templates(docs) if selects(service["selector"], as_created(d, t))]
        groups = [t for _d, t in group_templates(docs)]
        assert selected == groups, f"{name}: {SCHEDULERS} selects other pods than the groups' schedulers"
        scheduler_port = port_of(container(groups[0]["spec"], "scheduler"))
        frontend = by_kind(docs, "Deployment")["vmesh-frontend"]["spec"]["template"]["spec"]
        spec = parse_cli(container(frontend, "frontend")["args"]).scheduler
        assert spec.startswith(DNS_PREFIX), f"{name}: {spec} is not re-resolved"
        host, _, port = spec.removeprefix(DNS_PREFIX).rpartition(":")
        assert host == SCHEDULERS, name
        [entry] = [p for p in service["ports"] if p["port"] == int(port)]
        named = {p["name"]: p["containerPort"] for c in all_containers(groups[0]["spec"]) for p in c.get("ports", [])}
        assert named[entry["targetPort"]] == scheduler_port, name


def test_a_removed_group_drains_within_its_grace_period(rendered):
    """The scheduler's preStop outlasts one DNS refresh (frontends drop the group before it
    stops), then SIGTERM gives it DRAIN_GRACE_S + STOP_GRACE_S; its worker, a sidecar, gets
    SIGTERM only after it exited and takes as long at most: terminationGracePeriodSeconds must
    cover the three, or the kubelet kills requests that were still finishing."""
    for name, docs in rendered.items():
        for _doc, template in group_templates(docs):
            pod = template["spec"]
            scheduler = container(pod, "scheduler")
            assert preStop_sleep(scheduler) >= refresh_interval(docs), name
            needed = preStop_sleep(scheduler) + SHUTDOWN_S + SHUTDOWN_S
            assert pod["terminationGracePeriodSeconds"] >= needed, f"{name}: {needed} s needed"
            assert "service" not in scheduler["readinessProbe"]["grpc"]  # NOT_SERVING on SIGTERM: not Ready


def scaled_object(docs: list[dict]) -> dict:
    return by_kind(docs, "ScaledObject")[GROUP]["spec"]


def test_keda_scales_groups_on_what_the_schedulers_export(rendered, exported):
    """The ScaledObject targets the group workload, uncapped (more than one group), on waiting
    requests, KV-cache usage and the engine's time to first token; every series its queries read
    is one a scheduler serves, and each names a vLLM metric (tests/fixtures/vllm_metric_names.txt)."""
    docs = rendered["keda"]
    spec = scaled_object(docs)
    target = spec["scaleTargetRef"]
    [(workload, _t)] = group_templates(docs)
    assert (target["apiVersion"], target["kind"], target["name"]) == ("apps/v1", workload["kind"], GROUP)
    assert 1 <= spec["minReplicaCount"] < spec["maxReplicaCount"]
    triggers = {t["name"]: t for t in spec["triggers"]}
    assert set(triggers) == {"waiting", "kv", "ttft"}
    read = {}
    for trigger_name, trigger in triggers.items():
        assert trigger["type"] == "prometheus"
        assert trigger.get("metricType", "AverageValue") in ("AverageValue", "Value")
        metadata = trigger["metadata"]
        assert math.isfinite(float(metadata["threshold"])) and float(metadata["threshold"]) > 0
        assert urlsplit(metadata["serverAddress"]).scheme in ("http", "https")
        read[trigger_name] = promql_series(metadata["query"])
        assert read[trigger_name] and read[trigger_name] <= exported, \
            f"{trigger_name}: {read[trigger_name] - exported} are not exported by the scheduler"
    assert read["waiting"] == {"vmesh:num_requests_waiting"}
    assert read["kv"] == {"vmesh:kv_cache_usage_perc"}
    assert {s.rsplit("_", 1)[0] for s in read["ttft"]} == {"vmesh:request_queue_time_seconds",
                                                           "vmesh:request_prefill_time_seconds"}
    assert triggers["ttft"]["metricType"] == "Value"  # a latency: not divided over the replicas
    vllm = {line.removeprefix("vllm:") for line in (ROOT / "tests/fixtures/vllm_metric_names.txt").read_text()
            .splitlines() if line.startswith("vllm:")}
    for series in set().union(*read.values()):
        family = re.sub(r"_(bucket|sum|count|total)$", "", series.removeprefix("vmesh:"))
        assert family in vllm, series


def adapter_rules() -> list[dict]:
    manifest = yaml.safe_load((ROOT / "k8s/overlays/hpa-custom-metrics/prometheus-adapter-rules.yaml").read_text())
    return yaml.safe_load(manifest["data"]["config.yaml"])["rules"]


def adapter_metric_name(rule: dict) -> str:
    """The custom metric a prometheus-adapter rule serves: its series renamed by name.matches/as."""
    series = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", rule["seriesQuery"].strip("'")).group(0)
    name = rule["name"]
    return re.sub(name["matches"], re.sub(r"\$\{(\d+)\}", r"\\\1", name["as"]), series)


def test_hpa_alternative_scales_groups_on_adapter_metrics(rendered, exported):
    """The HPA targets the group workload, uncapped, on per-pod custom metrics that the documented
    prometheus-adapter rules serve, computed from series the scheduler exports."""
    import kubernetes_validate

    docs = rendered["hpa-custom-metrics"]
    hpa = by_kind(docs, "HorizontalPodAutoscaler")[GROUP]["spec"]
    [(workload, _t)] = group_templates(docs)
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": workload["kind"], "name": GROUP}
    assert 1 <= hpa["minReplicas"] < hpa["maxReplicas"]
    manifest = yaml.safe_load((ROOT / "k8s/overlays/hpa-custom-metrics/prometheus-adapter-rules.yaml").read_text())
    kubernetes_validate.validate(manifest, "1.33.0", strict=True)
    served = {}
    for rule in adapter_rules():
        assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}  # per group pod
        queries = rule["seriesQuery"] + rule["metricsQuery"]
        assert promql_series(queries) and promql_series(queries) <= exported, promql_series(queries) - exported
        served[adapter_metric_name(rule)] = rule
    wanted = [m["pods"]["metric"]["name"] for m in hpa["metrics"] if m["type"] == "Pods"]
    assert len(wanted) == len(hpa["metrics"]) == 3 and set(wanted) == set(served)


def all_queries(docs: list[dict]) -> list[str]:
    return [t["metadata"]["query"] for t in scaled_object(docs)["triggers"]]


def test_scaling_queries_are_valid_promql(rendered, tmp_path):
    """promtool parses every query the autoscaling overlays send (as recording rules)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        missing("no promtool (apt-get install prometheus)", ".ci/run installs Debian's prometheus package")
    queries = all_queries(rendered["keda"])
    for rule in adapter_rules():  # the adapter's templates, filled as it fills them
        queries.append(rule["metricsQuery"].replace("<<.Series>>", "vmesh:num_requests_waiting")
                       .replace("<<.LabelMatchers>>", 'namespace="vmesh"').replace("<<.GroupBy>>", "pod"))
    rules = {"groups": [{"name": "vmesh", "rules": [{"record": f"vmesh:query_{i}", "expr": q}
                                                     for i, q in enumerate(queries)]}]}
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    result = subprocess.run([promtool, "check", "rules", str(tmp_path / "rules.yml")], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_tensor_parallel_groups_are_leader_worker_sets(rendered):
    """Each group is one LeaderWorkerSet group: the leader is the base's group pod plus rank 0's
    settings (the rendezvous), the workers run ranks 1..N-1 from LWS's worker index, the leader's
    scheduler dials every rank by its pod's DNS name, and the worker pods outlive the leader's
    drain. LWS fields are checked by hand (no schema)."""
    docs = rendered["tensor-parallel"]
    lws = by_kind(docs, "LeaderWorkerSet")[GROUP]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and lws["spec"]["replicas"] >= 1
    assert lws["spec"]["startupPolicy"] == "LeaderCreated"  # ranks meet before any is Ready
    assert lws["spec"]["rolloutStrategy"]["type"] == "RollingUpdate"
    group = lws["spec"]["leaderWorkerTemplate"]
    size = group["size"]
    assert size >= 2 and group["restartPolicy"] in ("RecreateGroupOnPodRestart", "None")
    leader, member = group["leaderTemplate"]["spec"], group["workerTemplate"]["spec"]
    rank0, scheduler = container(leader, "worker"), container(leader, "scheduler")
    [rank] = member["containers"]
    assert not member.get("initContainers")
    env0, env = ({e["name"]: e for e in c["env"]} for c in (rank0, rank))
    tp_env = ("VMESH_TENSOR_PARALLEL_SIZE", "VMESH_TENSOR_PARALLEL_RANK", "VMESH_TENSOR_PARALLEL_INIT")
    assert set(tp_env) <= env_flags()
    for e in (env0, env):
        assert e["VMESH_TENSOR_PARALLEL_SIZE"]["value"] == "$(LWS_GROUP_SIZE)"
        host, _, port = e["VMESH_TENSOR_PARALLEL_INIT"]["value"].partition(":")
        assert host == "$(LWS_LEADER_ADDRESS)"
    assert {"name": "rendezvous", "containerPort": int(port)} in rank0["ports"]
    assert env0["VMESH_TENSOR_PARALLEL_RANK"]["value"] == "0"
    assert env["VMESH_TENSOR_PARALLEL_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        f"metadata.labels['{WORKER_INDEX}']"
    assert rank0["args"] == rank["args"] and parse_cli(rank["args"]).command == "worker"
    # The scheduler: rank 0 on loopback, rank i at pod <leader>-i of the Service LWS names after the set.
    scheduler_env = {e["name"]: e for e in scheduler["env"]}
    assert scheduler_env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    worker_port = port_of(rank)
    assert parse_cli(scheduler["args"]).workers.split(",") == [
        f"127.0.0.1:{worker_port}", *(f"$(POD_NAME)-{i}.{GROUP}:{worker_port}" for i in range(1, size))]
    # Apart from those settings, the leader is the base's group pod.
    [(_d, base)] = group_templates(rendered["base"])
    drop_tp = [{**c, "env": [e for e in c["env"] if e["name"] not in (*tp_env, "POD_NAME")],
                "ports": [p for p in c["ports"] if p["name"] != "rendezvous"],
                "args": [a for a in c["args"] if "$(POD_NAME)" not in a]} for c in all_containers(leader)]
    expected = [{**c, "args": [a for a in c["args"] if a != "127.0.0.1:50053"]} for c in all_containers(base["spec"])]
    assert drop_tp == expected
    assert group["leaderTemplate"]["metadata"] == base["metadata"]
    assert {k: v for k, v in leader.items() if k not in ("initContainers", "containers")} == \
        {k: v for k, v in base["spec"].items() if k not in ("initContainers", "containers")}
    # The ranks outlive the leader's scheduler: its preStop and drain, then their own shutdown.
    assert preStop_sleep(rank) >= preStop_sleep(scheduler) + SHUTDOWN_S
    assert member["terminationGracePeriodSeconds"] >= preStop_sleep(rank) + SHUTDOWN_S
    # Frontends dial leaders only; the ranks reach each other on any port, only within groups.
    selector = by_kind(docs, "Service")[SCHEDULERS]["spec"]["selector"]
    assert selector[WORKER_INDEX] == "0"
    ingress = by_kind(docs, "NetworkPolicy")[GROUP]["spec"]["ingress"]
    peers = [r for r in ingress if r.get("from") == [{"podSelector": {"matchLabels":
                                                                      {"app.kubernetes.io/name": GROUP}}}]]
    assert len(peers) == 1 and "ports" not in peers[0]
    for template in (group["leaderTemplate"], group["workerTemplate"]):
        assert template["metadata"]["labels"]["app.kubernetes.io/name"] == GROUP  # the policy's peers
