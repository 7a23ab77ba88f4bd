"""The docker-compose stack without Docker: each vmesh service's compose command runs as a
local process (service host names mapped to 127.0.0.1 ports), started in depends_on order
and gated on the compose healthcheck command; one request is served end to end; then a real
Prometheus server, with the compose scrape configuration mapped the same way, scrapes every
service and the key series must have moved."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from services.client import VmeshClient

ROOT = Path(__file__).resolve().parents[2]
START_ORDER = ["worker", "detokenizer", "scheduler", "frontend"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalStack:
    def __init__(self, compose: dict):
        self.compose = compose
        self.instances: dict[str, list[dict]] = {}  # service -> [{grpc, metrics}]
        for name in START_ORDER:
            replicas = compose["services"][name].get("deploy", {}).get("replicas", 1)
            self.instances[name] = [{"grpc": free_port(), "metrics": free_port()} for _ in range(replicas)]
        self.processes: list[subprocess.Popen] = []

    def address(self, name: str, i: int = 0) -> str:
        return f"127.0.0.1:{self.instances[name][i]['grpc']}"

    def map_arg(self, arg: str, instance: dict) -> str:
        if arg.startswith("dns:///"):
            name = arg[len("dns:///"):].split(":")[0]
            return ",".join(self.address(name, i) for i in range(len(self.instances[name])))
        host, _, port = arg.partition(":")
        if host in self.instances and port.isdigit():
            return self.address(host)
        return arg

    def command(self, name: str, instance: dict) -> list[str]:
        argv = list(self.compose["services"][name]["command"])
        for flag, key in (("--port", "grpc"), ("--metrics-port", "metrics")):
            argv[argv.index(flag) + 1] = str(instance[key])
        argv[argv.index("--host") + 1] = "127.0.0.1"
        if "--kv-cache-memory" in argv:  # a test-sized cache
            argv[argv.index("--kv-cache-memory") + 1] = "128MiB"
        return [self.map_arg(a, instance) for a in argv]

    def environment(self, name: str) -> dict[str, str]:
        env = {k: str(v) for k, v in self.compose["services"][name]["environment"].items()}
        env.pop("OTEL_EXPORTER_OTLP_ENDPOINT")  # no Jaeger here
        return {**os.environ, **env}

    def start(self) -> None:
        for name in START_ORDER:
            for instance in self.instances[name]:
                self.processes.append(subprocess.Popen([sys.executable, "-m", "services.cli",
                                                        *self.command(name, instance)],
                                                       cwd=ROOT, env=self.environment(name)))
            self.wait_healthy(name)

    def wait_healthy(self, name: str) -> None:
        """The compose healthcheck's own command, retried like `depends_on: service_healthy`."""
        test = self.compose["services"][name]["healthcheck"]["test"][1:]  # drop "CMD"
        for i in range(len(self.instances[name])):
            argv = [self.address(name, i) if ":" in a and a.startswith("127.0.0.1") else a for a in test[1:]]
            deadline = time.monotonic() + 180
            while subprocess.run([sys.executable, "-m", "services.cli", *argv], cwd=ROOT,
                                 capture_output=True).returncode != 0:
                assert all(p.poll() is None for p in self.processes), f"a process died while starting {name}"
                assert time.monotonic() < deadline, f"{name} never became healthy"
                time.sleep(0.5)

    def stop(self) -> None:
        for p in reversed(self.processes):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.processes:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


def prometheus_config(stack: LocalStack) -> dict:
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    config["global"]["scrape_interval"] = "1s"
    for job in config["scrape_configs"]:
        name = job["job_name"].removeprefix("vmesh-")
        job.pop("dns_sd_configs", None)
        job["static_configs"] = [{"targets": [f"127.0.0.1:{inst['metrics']}" for inst in stack.instances[name]]}]
    return config


def query(port: int, expr: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())["data"]["result"]


@pytest.fixture(scope="module")
def stack():
    stack = LocalStack(yaml.safe_load((ROOT / "docker-compose.yml").read_text()))
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()


def test_compose_commands_serve_a_request(stack):
    async def main():
        async with VmeshClient(stack.address("frontend")) as client:
            return await client.complete(chat=[{"role": "user", "content": "Say hello."}], max_tokens=8,
                                         temperature=0, ignore_eos=True)

    text, ids, last = asyncio.run(main())
    assert len(ids) == 8 and text and last.usage.completion_tokens == 8


def test_prometheus_scrapes_every_service(stack, tmp_path):
    binary = shutil.which("prometheus")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail(".ci/run installs Debian's prometheus package; it is missing")
        pytest.skip("no prometheus binary (apt-get install prometheus)")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(prometheus_config(stack)))
    port = free_port()
    server = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                               f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        async def traffic():
            async with VmeshClient(stack.address("frontend")) as client:
                await asyncio.gather(*(client.complete(text=f"Number {i}", max_tokens=6, ignore_eos=True)
                                       for i in range(3)))

        deadline = time.monotonic() + 60
        while True:
            try:
                up = query(port, "up")
                if len(up) == 5 and all(r["value"][1] == "1" for r in up):
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "Prometheus never scraped every service"
            time.sleep(0.5)
        assert {r["metric"]["job"] for r in up} == {f"vmesh-{n}" for n in START_ORDER}
        asyncio.run(traffic())
        deadline = time.monotonic() + 30
        wanted = {"vmesh:generation_tokens_total": 18, "vmesh:time_to_first_token_seconds_count": 3,
                  "vmesh:worker_steps_total": 6, "vmesh:request_queue_time_seconds_count": 3}
        while True:
            values = {}
            for series in wanted:
                result = query(port, f"sum({series})")
                values[series] = float(result[0]["value"][1]) if result else 0.0
            if all(values[s] >= n for s, n in wanted.items()):
                break
            assert time.monotonic() < deadline, f"series did not move: {values}"
            time.sleep(0.5)
        assert query(port, "vmesh:kv_cache_usage_perc")
        assert query(port, "vmesh:worker_duty_cycle")
    finally:
        server.terminate()
        server.wait(10)
