"""The docker-compose stack without Docker: each vmesh service's compose command runs as a
local process (service host names mapped to 127.0.0.1 ports, the certificate volume to a
directory the compose `certs` job fills), started in depends_on order and gated on the
compose healthcheck command; one request is served end to end over the stack's mutual TLS, and
both worker groups serve requests; then a real Prometheus server, with the compose scrape
configuration mapped the same way, scrapes every service, the key series must have moved, and
the KEDA overlay's scaling queries must be answered from the schedulers' series. Last, the two
groups scaled as Kubernetes scales them behind one DNS name: one joins, one is removed, under load."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml

from tests.support.checkout import ROOT
from tests.support.deployment import K8S_SETS, VMESH_SERVICES, by_kind, compose_services, render
from tests.support.eventually import eventually
from tests.support.prerequisites import missing
from vmesh.services.client import VmeshClient
from vmesh.services.common.grpc_server import DRAIN_GRACE_S
from vmesh.services.common.runtime.discovery import resolve_spec

CERT_VOLUME = "/var/lib/vmesh/certs"
PORTS = ("grpc", "metrics", "health", "http")


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """n distinct free ports: each socket stays bound until all are picked."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class LocalStack:
    def __init__(self, compose: dict, certs: Path):
        self.compose = compose
        self.certs = certs  # where the certificate volume lives on this host
        self.instances: dict[str, list[dict]] = {}  # service -> [{grpc, metrics, health, http}]
        self.services = compose_services(compose)  # compose service -> the vmesh service it runs
        counts = {name: compose["services"][name].get("deploy", {}).get("replicas", 1) for name in self.services}
        ports = iter(free_ports(len(PORTS) * sum(counts.values())))
        for name, replicas in counts.items():
            self.instances[name] = [{key: next(ports) for key in PORTS} for _ in range(replicas)]
        self.processes: list[subprocess.Popen] = []
        self.process_of: dict[tuple[str, int], subprocess.Popen] = {}

    def address(self, name: str, i: int = 0) -> str:
        return f"127.0.0.1:{self.instances[name][i]['grpc']}"

    def map_arg(self, arg: str, instance: dict) -> str:
        if "," in arg:  # a list of addresses
            return ",".join(self.map_arg(a, instance) for a in arg.split(","))
        if arg.startswith("dns:///"):
            name = arg[len("dns:///"):].split(":")[0]
            return ",".join(self.address(name, i) for i in range(len(self.instances[name])))
        host, _, port = arg.partition(":")
        if host in self.instances and port.isdigit():
            return self.address(host)
        return arg

    def command(self, name: str, instance: dict) -> list[str]:
        argv = list(self.compose["services"][name]["command"])
        for flag, key in (("--port", "grpc"), ("--metrics-port", "metrics"), ("--http-port", "http")):
            if flag in argv:
                argv[argv.index(flag) + 1] = str(instance[key])
        argv[argv.index("--host") + 1] = "127.0.0.1"
        if "--kv-cache-memory" in argv:  # a test-sized cache
            argv[argv.index("--kv-cache-memory") + 1] = "128MiB"
        return [self.map_arg(a, instance) for a in argv]

    def environment(self, name: str, instance: dict) -> dict[str, str]:
        env = {k: str(v).replace(CERT_VOLUME, str(self.certs))
               for k, v in self.compose["services"][name]["environment"].items()}
        env.pop("OTEL_EXPORTER_OTLP_ENDPOINT")  # no Jaeger here
        env["VMESH_HEALTH_PORT"] = str(instance["health"])
        return {**os.environ, **env}

    def make_certificates(self) -> None:
        """The compose `certs` job, run twice: the second run keeps what the first made."""
        argv = [a.replace(CERT_VOLUME, str(self.certs)) for a in self.compose["services"]["certs"]["command"]]
        for _ in range(2):
            subprocess.run([sys.executable, "-m", "vmesh", *argv], cwd=ROOT, check=True, timeout=120,
                           capture_output=True)

    def admin(self):
        """This test process as the mesh's admin, for calls straight to the scheduler."""
        from vmesh.services.common import tls

        return tls.Identity.from_files(self.certs / "admin.crt", self.certs / "admin.key", self.certs / "ca.crt")

    def start(self) -> None:
        self.make_certificates()
        for name in self.services:
            for i in range(len(self.instances[name])):
                self.start_instance(name, i)
            self.wait_healthy(name)

    def start_instance(self, name: str, i: int) -> None:
        instance = self.instances[name][i]
        process = subprocess.Popen([sys.executable, "-m", "vmesh", *self.command(name, instance)],
                                   cwd=ROOT, env=self.environment(name, instance))
        self.processes.append(process)
        self.process_of[name, i] = process

    def wait_healthy(self, name: str, instances: range | None = None) -> None:
        """The compose healthcheck's own command, retried like `depends_on: service_healthy`."""
        test = self.compose["services"][name]["healthcheck"]["test"][1:]  # drop "CMD"
        for i in instances or range(len(self.instances[name])):
            health = f"127.0.0.1:{self.instances[name][i]['health']}"
            argv = [health if a.startswith("127.0.0.1:") else a for a in test[1:]]
            deadline = time.monotonic() + 180
            # with the service's own environment, as the container runs its health check
            env = self.environment(name, self.instances[name][i])
            while subprocess.run([sys.executable, "-m", "vmesh", *argv], cwd=ROOT, env=env,
                                 capture_output=True).returncode != 0:
                assert all(p.poll() is None for p in self.process_of.values()), f"a process died starting {name}"
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
        hosts = [t.partition(":")[0] for sc in job.pop("static_configs", []) for t in sc["targets"]]
        hosts += [n for sd in job.pop("dns_sd_configs", []) for n in sd["names"]]
        job["static_configs"] = [{"targets": [f"127.0.0.1:{inst['metrics']}" for host in hosts
                                              for inst in stack.instances[host]]}]
    return config


def query(port: int, expr: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())["data"]["result"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    stack = LocalStack(yaml.safe_load((ROOT / "docker-compose.yml").read_text()), tmp_path_factory.mktemp("certs"))
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
        missing("no prometheus binary (apt-get install prometheus)", ".ci/run installs Debian's prometheus package")
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
                if len(up) == sum(map(len, stack.instances.values())) and all(r["value"][1] == "1" for r in up):
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "Prometheus never scraped every service"
            time.sleep(0.5)
        assert {r["metric"]["job"] for r in up} == {f"vmesh-{n}" for n in VMESH_SERVICES}
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
        # What KEDA would ask this Prometheus to scale worker groups: one finite value each.
        scaled = by_kind(render(ROOT / K8S_SETS["keda"]), "ScaledObject")["vmesh-group"]
        for trigger in scaled["spec"]["triggers"]:
            [sample] = query(port, trigger["metadata"]["query"])
            assert float(sample["value"][1]) >= 0, trigger["name"]
    finally:
        server.terminate()
        server.wait(10)


def scheduler_stats(stack: LocalStack, name: str):
    """GetSchedulerStats of one compose scheduler service, asked as the mesh's admin."""
    from vmesh.services.common.grpc_server import channel
    from vmesh.v1 import scheduler_pb2, scheduler_pb2_grpc

    async def ask():
        async with channel(stack.address(name), "scheduler", identity=stack.admin()) as ch:
            return await scheduler_pb2_grpc.SchedulerServiceStub(ch).GetSchedulerStats(
                scheduler_pb2.GetSchedulerStatsRequest(), timeout=5)

    return asyncio.run(ask())


def schedulers(stack: LocalStack) -> list[str]:
    return [name for name, role in stack.services.items() if role == "scheduler"]


def test_the_frontend_uses_both_worker_groups(stack):
    """Concurrent requests with different prompts spread over the two groups: each scheduler
    computes some of them (its step count moves)."""
    before = {name: scheduler_stats(stack, name).steps for name in schedulers(stack)}
    assert len(before) == 2

    async def burst(n: int) -> None:
        async with VmeshClient(stack.address("frontend")) as client:
            results = await asyncio.gather(*(client.complete(text=f"Question {i}: what is {i} squared?",
                                                             max_tokens=4, ignore_eos=True) for i in range(n)))
            assert all(len(ids) == 4 for _, ids, _ in results)

    asyncio.run(burst(8))
    after = {name: scheduler_stats(stack, name).steps for name in schedulers(stack)}
    assert all(after[name] > before[name] for name in before), f"a group took no request: {before} -> {after}"


def detokenized_tokens(stack: LocalStack, i: int) -> float:
    url = f"http://127.0.0.1:{stack.instances['detokenizer'][i]['metrics']}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(("vmesh:detokenizer_tokens_total ", "vmesh:detokenizer_tokens_total{")):
                return float(line.rsplit(maxsplit=1)[1])  # after the labels (model_name=...)
    raise AssertionError("no vmesh:detokenizer_tokens_total series")


def test_a_restarted_detokenizer_replica_is_reconnected(stack):
    """Kill one of the two detokenizer replicas: requests keep being served by the other; start it
    again on its address: the scheduler and the frontend reopen their streams to it and use it."""
    async def serve(n: int, deadline: float) -> None:
        async with VmeshClient(stack.address("frontend")) as client:
            while True:
                try:  # concurrent requests spread over the replicas (least outstanding first)
                    results = await asyncio.gather(*(client.complete(text=f"Count to {i}.", max_tokens=4,
                                                                     ignore_eos=True) for i in range(n)))
                    assert all(len(ids) == 4 for _, ids, _ in results)
                    return
                except grpc.aio.AioRpcError as exc:  # routed to the dead replica before anyone noticed
                    assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
                    assert time.monotonic() < deadline, "requests kept failing after a replica died"
                    await asyncio.sleep(0.5)

    victim = stack.process_of["detokenizer", 0]
    victim.kill()
    victim.wait(10)
    asyncio.run(serve(4, time.monotonic() + 20))
    stack.start_instance("detokenizer", 0)
    stack.wait_healthy("detokenizer", range(1))
    deadline = time.monotonic() + 30
    while detokenized_tokens(stack, 0) == 0:  # a fresh process: its counter starts at zero
        assert time.monotonic() < deadline, "the restarted replica never received a request"
        asyncio.run(serve(4, deadline))


def test_the_requests_of_a_killed_frontend_are_stopped(stack):
    """A frontend dies mid-stream: its detokenizer subscriptions end, the detokenizers tell the
    scheduler, and the scheduler stops computing for nobody and frees the request's KV blocks."""
    from vmesh.services.common.grpc_server import channel
    from vmesh.v1 import scheduler_pb2, scheduler_pb2_grpc

    async def main() -> scheduler_pb2.GetSchedulerStatsResponse:
        async with VmeshClient(stack.address("frontend")) as client, contextlib.AsyncExitStack() as channels:
            stubs = [scheduler_pb2_grpc.SchedulerServiceStub(await channels.enter_async_context(
                channel(stack.address(name), "scheduler", identity=stack.admin()))) for name in schedulers(stack)]
            stream = client.generate(text="Tell me a very long story.", max_tokens=1500, ignore_eos=True)
            await stream.__anext__()
            # The group computing it (this test runs alone on the stack).
            running = [(await s.GetSchedulerStats(scheduler_pb2.GetSchedulerStatsRequest(), timeout=5)).num_running
                       for s in stubs]
            [scheduler] = [s for s, n in zip(stubs, running) if n == 1]
            stack.process_of["frontend", 0].kill()
            with pytest.raises(grpc.aio.AioRpcError):
                async for _ in stream:
                    pass
            deadline = time.monotonic() + 10  # the request alone would run for ~40 s more
            while True:
                stats = await scheduler.GetSchedulerStats(scheduler_pb2.GetSchedulerStatsRequest(), timeout=5)
                if stats.num_running == 0 and stats.num_waiting == 0:
                    return stats
                assert time.monotonic() < deadline, f"still computing for a dead frontend: {stats}"
                await asyncio.sleep(0.2)

    try:
        stats = asyncio.run(main())
        assert stats.num_used_blocks == 0
    finally:
        stack.process_of["frontend", 0].wait(10)
        stack.start_instance("frontend", 0)
        stack.wait_healthy("frontend")


def test_a_restarted_scheduler_takes_over_its_workers(stack):
    """The scheduler dies and comes back on its address (a pod restart, a rolling update): the
    worker forgets the old session's requests and step numbers, and the group serves again."""
    async def complete(prompt: str) -> list[int]:
        async with VmeshClient(stack.address("frontend")) as client:
            _, ids, _ = await client.complete(text=prompt, max_tokens=6, temperature=0, ignore_eos=True)
            return ids

    async def complete_when_back(prompt: str, deadline: float) -> list[int]:
        while True:
            try:
                return await complete(prompt)
            except grpc.aio.AioRpcError as exc:  # the frontend has not reconnected yet
                assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
                assert time.monotonic() < deadline, f"the group never served again: {exc.details()}"
                await asyncio.sleep(0.5)

    before = asyncio.run(complete("The capital of France is"))
    victim = stack.process_of["scheduler", 0]
    victim.kill()
    victim.wait(10)
    stack.start_instance("scheduler", 0)
    stack.wait_healthy("scheduler")
    # Internal channels retry within 2 s (bounded backoff); gRPC's default backoff had the
    # frontend wait ~27 s after a restart.
    back_at = time.monotonic()
    assert asyncio.run(complete_when_back("The capital of France is", time.monotonic() + 60)) == before
    # The other group may have served that: the restarted one must take requests too (a fresh
    # process, whose step count starts at zero).
    async def burst() -> None:
        async with VmeshClient(stack.address("frontend")) as client:
            await asyncio.gather(*(client.complete(text=f"Name {i} colours.", max_tokens=2, ignore_eos=True)
                                   for i in range(4)))

    while scheduler_stats(stack, "scheduler").steps == 0:
        assert time.monotonic() - back_at < 15, "the frontend took too long to reconnect to the restarted scheduler"
        asyncio.run(burst())


class ScaledName:
    """The scheduler tier's DNS name as a headless Service answers it while groups come and go
    (loopback cannot give one name several addresses): the test sets its addresses, and counts
    the frontend's look-ups of it (one per refresh interval)."""

    SPEC = "dns:///vmesh-scheduler:50052"

    def __init__(self, *addresses: str):
        self.addresses = list(addresses)
        self.lookups = 0
        self._lock = threading.Lock()  # the frontend looks up from a thread of its own

    def answer(self, *addresses: str) -> int:
        """From now on, answer `addresses`; returns the number of the first look-up that gets them."""
        with self._lock:
            self.addresses = list(addresses)
            return self.lookups + 1

    def __call__(self, spec: str) -> list[str]:
        if spec != self.SPEC:
            return resolve_spec(spec)
        with self._lock:
            self.lookups += 1
            return list(self.addresses)


# One prompt per client, short (no full KV block: no prefix hits), short greedy outputs; a
# refresh interval long beside the few round trips of a group's join on a loaded machine.
SCALING_PROMPTS = [f"Name a colour, number {i}." for i in range(4)]
SCALING_TOKENS = 8
SCALING_REFRESH_S = 2.0
SCALING_BUDGET_S = 120.0


async def greedy(core, prompt: str) -> list[int] | str:
    """The request's output tokens, or its error."""
    from vmesh.services.common.generation import GenerationRequest
    from vmesh.services.common.types import SamplingParams
    from vmesh.services.frontend.errors import RequestError

    tokens: list[int] = []
    try:
        async for out in core.generate(GenerationRequest(prompt, SamplingParams(
                temperature=0.0, max_tokens=SCALING_TOKENS, ignore_eos=True))):
            tokens += out.token_ids
    except RequestError as exc:
        return f"{exc.code.name}: {exc}"
    return tokens


class StreamingLoad:
    """One client per prompt, each sending its prompt again as soon as it has an answer, until
    told to stop: new requests keep arriving, and some are always running."""

    def __init__(self, core):
        self.results: list[tuple[int, list[int] | str]] = []  # (prompt index, outcome), as they end
        self.stopping = asyncio.Event()
        self.clients = [asyncio.create_task(self._client(core, i)) for i in range(len(SCALING_PROMPTS))]

    async def _client(self, core, i: int) -> None:
        while not self.stopping.is_set():
            self.results.append((i, await greedy(core, SCALING_PROMPTS[i])))

    async def stop(self, cancel: bool = False) -> list[tuple[int, list[int] | str]]:
        """Once each client's request in flight has ended (`cancel`: at once)."""
        self.stopping.set()
        for client in self.clients:
            if cancel:
                client.cancel()
        await asyncio.gather(*self.clients, return_exceptions=cancel)
        return self.results


def test_a_group_joins_under_load_within_one_refresh_and_one_removed_loses_no_request(stack, embedded_tokenizer):
    """Kubernetes scaling worker groups, seen by a frontend that finds them by DNS (in this
    process, its resolver the test's): under a steady greedy load on one group, a second
    group's address appears in the name's answer: the frontend joins it at its first look-up
    after, and the requests it sends next go there. Then, while that group runs some,
    its address leaves the answer and its scheduler gets SIGTERM at once (the pod deleted,
    without even the preStop wait): it drains (NOT_SERVING, new submissions go to the other
    group, its running requests finish) and exits 0. No request fails or fails over, every
    output equals the undisturbed first round's, the frontend lets the group go, and the
    remaining group holds no KV block once idle."""
    from functools import partial

    from prometheus_client import CollectorRegistry

    from vmesh.services.common import tls
    from vmesh.services.common.grpc_server import channel
    from vmesh.services.common.metrics import FrontendMetrics
    from vmesh.services.frontend import schedulers
    from vmesh.services.frontend.core import FrontendCore
    from vmesh.services.frontend.settings import FrontendServiceSettings
    from vmesh.services.frontend.subscriptions import subscribe_over_grpc
    from vmesh.v1 import scheduler_pb2, scheduler_pb2_grpc

    remaining, leaving = stack.address("scheduler"), stack.address("scheduler-2")
    victim = stack.process_of["scheduler-2", 0]
    name = ScaledName(remaining)
    identity = tls.Identity.from_files(stack.certs / "frontend.crt", stack.certs / "frontend.key",
                                       stack.certs / "ca.crt")
    registry = CollectorRegistry()

    async def main():
        core = FrontendCore(FrontendServiceSettings(
            scheduler_addresses=[ScaledName.SPEC], replica_refresh_interval_s=SCALING_REFRESH_S,
            detokenizer_addresses=[stack.address("detokenizer", i) for i in range(2)]),
            tokenizer=embedded_tokenizer, metrics=FrontendMetrics(registry, ""), resolve=name,
            connect_scheduler=partial(schedulers.connect, identity=identity),
            subscribe=partial(subscribe_over_grpc, identity=identity))
        load = None
        async with channel(remaining, "scheduler", identity=stack.admin()) as a, \
                channel(leaving, "scheduler", identity=stack.admin()) as b:
            async def stats(ch) -> scheduler_pb2.GetSchedulerStatsResponse:
                return await scheduler_pb2_grpc.SchedulerServiceStub(ch).GetSchedulerStats(
                    scheduler_pb2.GetSchedulerStatsRequest(), timeout=5)

            def new_group() -> schedulers.SchedulerGroup | None:
                group = core.schedulers.groups.get(leaving)
                return group if group is not None and group.routable else None

            try:
                await core.connect()
                load = StreamingLoad(core)
                # The first round is the undisturbed run: one group, nothing changing.
                await eventually(lambda: len({i for i, _ in load.results}) == len(SCALING_PROMPTS),
                                 "the first round did not end", budget_s=SCALING_BUDGET_S)
                steps_before = (await stats(b)).steps
                listed = name.answer(remaining, leaving)  # the new group is Ready: the Service lists it
                await eventually(new_group, "the frontend never joined the new group", budget_s=SCALING_BUDGET_S)
                joined_at = name.lookups
                earlier = set(core.outboxes)  # requests in flight before it joined

                def sent_since() -> list[schedulers.SchedulerGroup]:
                    return [o.group for key, o in core.outboxes.items() if key not in earlier and o.group is not None]

                # Each client's next request (one of them may go to the first group while both are idle).
                await eventually(lambda: len(sent_since()) >= len(SCALING_PROMPTS),
                                 "the clients sent nothing after the group joined", budget_s=SCALING_BUDGET_S)
                first_sent_to = sorted(group.address for group in sent_since())
                running = await eventually_async(lambda: stats(b),
                                                 lambda s: s.num_running > 0 and s.steps > steps_before)
                unlisted = name.answer(remaining)  # the pod is deleted: its address leaves the Service...
                victim.send_signal(signal.SIGTERM)  # ...and its scheduler is told to stop at once
                signalled = time.monotonic()
                exit_code = await asyncio.to_thread(victim.wait, SCALING_BUDGET_S)
                drained_s = time.monotonic() - signalled
                await eventually(lambda: name.lookups >= unlisted and leaving not in core.schedulers.groups,
                                 "the frontend kept the removed group", budget_s=SCALING_BUDGET_S)
                results = await load.stop()  # the requests sent since, all to the remaining group, end too
                idle = await eventually_async(lambda: stats(a), lambda s: s.num_running == s.num_waiting == 0)
                return listed, joined_at, first_sent_to, running, exit_code, drained_s, results, idle
            finally:
                if load is not None and not load.stopping.is_set():  # failed: nothing may outlive the core
                    await load.stop(cancel=True)
                await core.close()

    # Last in the module: the removed group stays stopped (starting it again would only cost time).
    listed, joined_at, first_sent_to, running, exit_code, drained_s, results, idle = asyncio.run(
        asyncio.wait_for(main(), 3 * SCALING_BUDGET_S))
    assert joined_at == listed, "the frontend did not join the group at the first look-up that listed it"
    assert leaving in first_sent_to, f"requests sent after the new group joined went to {first_sent_to}"
    assert running.num_running > 0  # the removed group was computing when told to stop
    assert exit_code == 0, "the removed group's scheduler did not drain and exit cleanly"
    reference = {}
    for i, outcome in results:
        reference.setdefault(i, outcome)  # the first round's
    assert all(isinstance(r, list) and len(r) == SCALING_TOKENS for r in reference.values()), reference
    assert [outcome for _, outcome in results] == [reference[i] for i, _ in results]
    failovers = sum(s.value for metric in registry.collect() if metric.name == "vmesh:request_failovers"
                    for s in metric.samples if s.name.endswith("_total"))
    # Its running requests finished there, unless the drain's grace ran out first (a machine so
    # loaded that a step takes seconds): then they continued on the other group, as lossless.
    assert failovers == 0 or drained_s >= DRAIN_GRACE_S, \
        f"the drain cut requests short after {drained_s:.1f} s: {failovers:.0f} failed over"
    assert idle.num_used_blocks == 0, "KV blocks leaked on the remaining group"


async def eventually_async(ask, condition, budget_s: float = SCALING_BUDGET_S):
    """`await ask()`'s first answer of which `condition` holds, asked every 50 ms."""
    deadline = time.monotonic() + budget_s
    while not condition(answer := await ask()):
        assert time.monotonic() < deadline, f"never held; last: {answer}"
        await asyncio.sleep(0.05)
    return answer
