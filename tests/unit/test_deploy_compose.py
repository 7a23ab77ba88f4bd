"""docker-compose.yml, checked statically: against the Compose Specification schema, every
container command through the real `vmesh` CLI parser, and what Prometheus and Grafana read."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import zipfile

import pytest
import yaml

from tests.support.checkout import ROOT
from tests.support.deployment import VMESH_SERVICES, compose_services, env_flags, parse_cli


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


def test_compose_commands_and_environment_parse(compose):
    known_env = env_flags()
    services = compose_services(compose)
    assert set(services.values()) == set(VMESH_SERVICES)
    for name, role in services.items():
        service = compose["services"][name]
        args = parse_cli(service["command"])
        assert args.command == role
        for key in service["environment"]:
            assert not key.startswith("VMESH_") or key in known_env, f"{name}: unknown setting {key}"
        environment = {**service["environment"]}
        health = service["healthcheck"]["test"]
        assert parse_cli(health[2:]).command == "health"
        assert health[3] == f"127.0.0.1:{environment['VMESH_HEALTH_PORT']}"  # plaintext, health only
        # mutual TLS: this role's certificate from the certs volume, which the certs job fills once
        assert environment["VMESH_TLS_CERT"] == f"/var/lib/vmesh/certs/{role}.crt"
        assert environment["VMESH_TLS_KEY"] == f"/var/lib/vmesh/certs/{role}.key"
        assert environment["VMESH_TLS_CA"] == "/var/lib/vmesh/certs/ca.crt"
        assert "certs:/var/lib/vmesh/certs:ro" in service["volumes"]
        assert args.metrics_port == 9400
    assert compose["services"]["detokenizer"]["deploy"]["replicas"] == 2
    certs = compose["services"]["certs"]
    assert parse_cli(certs["command"]).if_missing and "certs" in compose["volumes"]
    for name, role in services.items():
        if role in ("worker", "detokenizer"):
            assert compose["services"][name]["depends_on"]["certs"]["condition"] == "service_completed_successfully"


def test_compose_runs_two_worker_groups_the_frontend_reaches(compose):
    """Each scheduler dials a worker of its own (a group each) once it is healthy, and the
    frontend lists every group's scheduler."""
    services = compose_services(compose)
    schedulers = [n for n, role in services.items() if role == "scheduler"]
    workers = [n for n, role in services.items() if role == "worker"]
    assert len(schedulers) == len(workers) == 2
    dialled = []
    for name in schedulers:
        [worker] = parse_cli(compose["services"][name]["command"]).workers.split(",")
        host, _, port = worker.partition(":")
        assert compose["services"][name]["depends_on"][host]["condition"] == "service_healthy"
        assert int(port) == parse_cli(compose["services"][host]["command"]).port
        dialled.append(host)
    assert sorted(dialled) == sorted(workers)  # one worker per group, none shared
    [frontend] = [n for n, role in services.items() if role == "frontend"]
    listed = parse_cli(compose["services"][frontend]["command"]).scheduler.split(",")
    assert sorted(listed) == sorted(f"{n}:{parse_cli(compose['services'][n]['command']).port}" for n in schedulers)
    for name in schedulers:
        assert compose["services"][frontend]["depends_on"][name]["condition"] == "service_healthy"


def test_prometheus_scrapes_every_service(compose):
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    services = compose_services(compose)
    for role in VMESH_SERVICES:
        job = jobs[f"vmesh-{role}"]
        targets = [t for sc in job.get("static_configs", []) for t in sc["targets"]]
        targets += [f"{n}:{sd['port']}" for sd in job.get("dns_sd_configs", []) for n in sd["names"]]
        names = [n for n, r in services.items() if r == role]
        assert sorted(targets) == sorted(f"{n}:{parse_cli(compose['services'][n]['command']).metrics_port}"
                                         for n in names), role


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
