"""Lossless failover: under a steady load of greedy and seeded requests, kill -9 the worker, a
detokenizer replica, the scheduler and a frontend, one test each on one mesh of two frontends.
`vmesh serve` restarts each in place; every request ends with exactly the text and tokens of an
undisturbed run (a dead frontend's clients resume their streams through the other frontend, over
gRPC and HTTP); a client that does not resume loses its connection and its request stops
computing; no KV block is leaked."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc
import httpx
import pytest

from tests.e2e.conftest import wait_idle
from tests.support.eventually import eventually, eventually_blocking
from tests.support.scrape import scrape
from vmesh.services.bench.mesh import RunningMesh, start_mesh
from vmesh.services.client import VmeshClient

NUM_REQUESTS = 6  # with --max-num-seqs 4: some are queued when the kill comes
MAX_TOKENS = 40
CLIENT_TIMEOUT_S = 150.0  # far beyond any failover here; a hang fails the test instead of CI


@dataclass
class Outcome:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: int = 0
    completion_tokens: int = 0
    error: grpc.StatusCode | None = None
    longest_gap_s: float = 0.0  # the longest wait between two outputs: the pause a client saw
    finishes: int = 0  # responses with a finish reason: exactly one, the last

    @property
    def result(self) -> tuple[str, list[int], int, int]:
        return self.text, self.token_ids, self.finish_reason, self.completion_tokens


def sampling(i: int) -> dict:
    """Half greedy, half seeded sampling: both must come out of a failover unchanged."""
    return {"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.9, "top_p": 0.95, "seed": 100 + i}


async def one(client: VmeshClient, i: int, progress: list[int], max_tokens: int = MAX_TOKENS) -> Outcome:
    outcome = Outcome()
    last = time.monotonic()
    try:
        async for out in client.generate(text=f"Write a short story about a robot, number {i}.",
                                         max_tokens=max_tokens, ignore_eos=True, timeout=CLIENT_TIMEOUT_S,
                                         **sampling(i)):
            now = time.monotonic()
            if outcome.token_ids:
                outcome.longest_gap_s = max(outcome.longest_gap_s, now - last)
            last = now
            outcome.text += out.text
            outcome.token_ids += out.token_ids
            progress[i] = len(outcome.token_ids)
            assert not outcome.finishes, "output after the finish"
            if out.finish_reason or out.HasField("usage"):
                outcome.finishes += 1
                outcome.finish_reason = out.finish_reason
                outcome.completion_tokens = out.usage.completion_tokens
    except grpc.aio.AioRpcError as exc:
        outcome.error = exc.code()
    return outcome


async def load(address: str | list[str], kill: Callable[[], object] | None = None, max_tokens: int = MAX_TOKENS,
               kill_after_tokens: int = NUM_REQUESTS * MAX_TOKENS // 3) -> list[Outcome]:
    """NUM_REQUESTS concurrent streams; `kill` runs once `kill_after_tokens` have streamed.
    `address`: several frontends' to resume through the next when one goes away."""
    progress = [0] * NUM_REQUESTS
    async with VmeshClient(address, max_resumes=1) as client:
        tasks = [asyncio.create_task(one(client, i, progress, max_tokens)) for i in range(NUM_REQUESTS)]
        if kill is not None:
            await eventually(lambda: sum(progress) >= kill_after_tokens or any(t.done() for t in tasks),
                             budget_s=CLIENT_TIMEOUT_S, interval_s=0.01)
            assert not any(t.done() for t in tasks), [t.result() for t in tasks if t.done()]
            kill()
        return await asyncio.gather(*tasks)


def wait_restarted(mesh: RunningMesh, name: str, restarts: int, timeout: float = 120) -> None:
    def restarted() -> bool:
        mesh.refresh()
        return mesh.restarts.get(name) == restarts

    eventually_blocking(restarted, lambda: f"{name} was not restarted; launcher output:\n" + "".join(mesh.output[-30:]),
                        budget_s=timeout, interval_s=0.2)


def assert_no_block_leaked(mesh: RunningMesh) -> None:
    stats = wait_idle(mesh)
    assert stats.num_used_blocks == 0, "KV blocks leaked"


@dataclass
class Chaos:
    """One mesh for every scenario (each kills one process, which is restarted in place), and the
    load's undisturbed outcomes that each must reproduce."""
    mesh: RunningMesh
    reference: list[Outcome]
    report: dict[str, str] = field(default_factory=dict)


@pytest.fixture(scope="module")
def chaos() -> Iterator[Chaos]:
    # Recovery timeouts far beyond a restart here: on a slow machine a reload must not turn into a failure.
    mesh = start_mesh("--detokenizers", "2", "--frontends", "2", "--max-num-seqs", "4", "--metrics",
                      "--worker-recovery-timeout", "120", "--failover-timeout", "120")
    try:
        reference = asyncio.run(load(mesh.address))
        assert all(o.error is None and len(o.token_ids) == MAX_TOKENS for o in reference)
        assert [o.result for o in asyncio.run(load(mesh.address))] == [o.result for o in reference], \
            "the load must be reproducible undisturbed"
    except BaseException:
        mesh.stop()
        raise
    chaos = Chaos(mesh, reference)
    yield chaos
    if os.environ.get("VMESH_CHAOS_REPORT"):
        print("\nchaos:", chaos.report)
    # After the tests: a failure here is reported on its own, beside theirs, never instead of one.
    assert mesh.stop() == 0


def counted(mesh: RunningMesh, service: str, series: str) -> float:
    return scrape(mesh.metrics[service]).get(series, 0.0)


# Each victim's failovers, as the service that handles them counts them.
FAILOVER_COUNTERS = {"worker": ("scheduler", "vmesh:worker_failovers_total"),
                     "detokenizer-0": ("frontend", 'vmesh:request_failovers_total{kind="detokenizer"}'),
                     "scheduler": ("frontend", 'vmesh:request_failovers_total{kind="scheduler"}')}


@pytest.mark.parametrize("victim", ["worker", "detokenizer-0", "scheduler"])
def test_a_killed_process_is_restarted_and_no_request_is_lost(chaos, victim):
    mesh, report = chaos.mesh, chaos.report
    pid, address, restarts = 0, mesh.services[victim][0], mesh.restarts[victim]
    counter = FAILOVER_COUNTERS[victim]
    failovers = counted(mesh, *counter)

    def kill() -> None:
        nonlocal pid
        pid = mesh.kill_service(victim)

    outcomes = asyncio.run(load(mesh.address, kill))
    for i, (got, want) in enumerate(zip(outcomes, chaos.reference)):
        assert got.error is None, f"{victim} killed: request {i} failed with {got.error}"
        assert got.result == want.result, f"{victim} killed: request {i} differs from the undisturbed run"
    wait_restarted(mesh, victim, restarts + 1)
    assert mesh.services[victim][1] != pid and mesh.services[victim][0] == address  # same address
    report[victim] = f"{NUM_REQUESTS} recovered, 0 failed, longest pause " \
                     f"{max(o.longest_gap_s for o in outcomes):.1f} s"
    if victim == "worker":  # one death, one failover of the whole group
        assert counted(mesh, *counter) - failovers == 1
    else:  # the frontend (never restarted here) counts every request's failover
        assert counted(mesh, *counter) - failovers >= 1
    assert_no_block_leaked(mesh)


def test_a_killed_frontend_s_clients_resume_through_the_other_and_lose_nothing(chaos):
    mesh = chaos.mesh
    restarts = mesh.restarts["frontend"]
    addresses = [entry.address for entry in mesh.description.frontends]
    assert len(addresses) == 2
    outcomes = asyncio.run(load(addresses, lambda: mesh.kill_service("frontend")))
    for i, (got, want) in enumerate(zip(outcomes, chaos.reference)):
        assert got.error is None, f"frontend killed: request {i} failed with {got.error}"
        assert got.result == want.result, f"frontend killed: request {i} differs from the undisturbed run"
    wait_restarted(mesh, "frontend", restarts + 1)
    chaos.report["frontend resumed"] = f"{NUM_REQUESTS} resumed through frontend-1, 0 lost, longest pause " \
                                       f"{max(o.longest_gap_s for o in outcomes):.1f} s"
    assert_no_block_leaked(mesh)


def test_a_killed_frontend_s_requests_that_nobody_resumes_stop_computing(chaos):
    """Clients that know one frontend: their connections break (UNAVAILABLE); the requests stop
    computing long before they could have finished; the restarted frontend serves the same outputs."""
    mesh = chaos.mesh
    restarts = mesh.restarts["frontend"]
    outcomes = asyncio.run(load(mesh.address, lambda: mesh.kill_service("frontend"), max_tokens=2000,
                                kill_after_tokens=2 * NUM_REQUESTS))
    assert {o.error for o in outcomes} == {grpc.StatusCode.UNAVAILABLE}
    stats = wait_idle(mesh, timeout=30)
    assert stats.num_running == 0 and stats.num_waiting == 0, "a dead frontend's requests kept computing"
    wait_restarted(mesh, "frontend", restarts + 1)
    assert [o.result for o in asyncio.run(load(mesh.address))] == [o.result for o in chaos.reference]
    chaos.report["frontend"] = f"{NUM_REQUESTS} failed with UNAVAILABLE (their connection), computing stopped"
    assert_no_block_leaked(mesh)


def test_fail_fast_stops_the_mesh_naming_the_dead_service():
    mesh = start_mesh("--fail-fast")
    try:
        pid = mesh.kill_service("detokenizer-0")
        mesh.process.wait(60)
        assert mesh.process.returncode == 1
        mesh.wait_for_output(rf"vmesh: detokenizer-0 \(pid {pid}\) exited with code -9; stopping the mesh")
    finally:
        mesh.stop()



# --- HTTP: a killed frontend's SSE streams resume through the other with Last-Event-ID -------------

HTTP_BODIES = [
    ("chat/completions", {"messages": [{"role": "user", "content": "Write a short story about a robot."}]}),
    ("completions", {"prompt": "Once upon a time, a robot", "n": 2}),
]


def sse_events(lines: list[str]) -> list[tuple[str, dict]]:
    """(id, payload) of each data event; an event without an id keeps the last one, as SSE says."""
    events, event_id, last_id = [], "", ""
    for line in lines:
        if line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: ") and line != "data: [DONE]":
            last_id = event_id or last_id
            events.append((last_id, json.loads(line[6:])))
            event_id = ""
    return events


def texts(events: list[tuple[str, dict]]) -> dict[int, str]:
    out: dict[int, str] = {}
    for _, payload in events:
        for choice in payload["choices"]:
            piece = choice["delta"].get("content") if "delta" in choice else choice["text"]
            out[choice["index"]] = out.get(choice["index"], "") + (piece or "")
    return out


async def http_stream(url: str, body: dict, lines: list[str], last_event_id: str = "") -> None:
    headers = {"Vmesh-Resumable": "1", **({"Last-Event-ID": last_event_id} if last_event_id else {})}
    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S) as http, \
            http.stream("POST", url, json=body, headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            lines.append(line)


def test_a_killed_frontend_s_http_streams_resume_with_last_event_id(chaos):
    mesh = chaos.mesh
    first, second = (entry.http_url for entry in mesh.description.frontends)
    bodies = [(path, {**body, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
                      "stream": True}) for path, body in HTTP_BODIES]

    async def run() -> tuple[list[dict[int, str]], list[dict[int, str]]]:
        references = []
        for path, body in bodies:
            lines: list[str] = []
            await http_stream(f"{second}/{path}", body, lines)
            references.append(texts(sse_events(lines)))
        received: list[list[str]] = [[] for _ in bodies]
        streams = [asyncio.create_task(http_stream(f"{first}/{path}", body, lines))
                   for (path, body), lines in zip(bodies, received)]
        await eventually(lambda: all(len(sse_events(lines)) >= 4 for lines in received), budget_s=CLIENT_TIMEOUT_S,
                         interval_s=0.01)
        mesh.kill_service("frontend")
        for stream in streams:
            with pytest.raises(httpx.HTTPError):  # the connection broke mid-stream
                await stream
        resumed = []
        for (path, body), lines in zip(bodies, received):
            events = sse_events(lines)
            assert events and events[-1][0], "every event so far carries an id"
            rest: list[str] = []
            await http_stream(f"{second}/{path}", body, rest, last_event_id=events[-1][0])
            whole = texts(events)
            for index, text in texts(sse_events(rest)).items():
                whole[index] = whole.get(index, "") + text
            resumed.append(whole)
        return references, resumed

    restarts = mesh.restarts["frontend"]
    references, resumed = asyncio.run(run())
    assert resumed == references
    wait_restarted(mesh, "frontend", restarts + 1)
    assert_no_block_leaked(mesh)
