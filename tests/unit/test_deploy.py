"""The deployment files, checked statically: docker-compose.yml against the Compose
Specification schema, Kubernetes manifests against Kubernetes schemas, and every container
command through the real `vmesh` CLI parser."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from services.cli import build_parser

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
