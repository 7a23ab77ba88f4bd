"""CPU per streamed token of the HTTP frontend (and, with --mesh, of every service).

Isolated (the default): the product's frontend process (`vmesh frontend`, the embedded model's
tokenizer) runs against a stand-in scheduler and detokenizer served over real gRPC from this
process; the stand-in detokenizer sends one token per running request every `--step-ms`, as a
decoding batch does. `--streams` clients stream chat completions over HTTP (Server-Sent Events)
at once, and the frontend's CPU seconds over the burst are divided by the output tokens.

--mesh: `vmesh serve` with the embedded model instead; every service's CPU per token.

--baseline-ref REF: the same run, alternated round by round, over a worktree of REF (made in a
temporary directory and removed after): before and after in one sitting. The text every client
assembles is digested per tree, so a change of output shows.

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.frontend_stream_cost --baseline-ref main \\
        [--streams 32] [--max-tokens 128] [--step-ms 20] [--rounds 3] [--mesh] [--profile FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
from grpc_health.v1 import health, health_pb2_grpc

from benchmarks.baseline_tree import baseline_trees
from vmesh.services.bench.mesh import start_mesh
from vmesh.services.common.grpc_server import SERVER_OPTIONS
from vmesh.services.common.model_loading import EMBEDDED_MODEL_NAME
from vmesh.services.common.types import FinishReason, OutputBatch, StreamOutput
from vmesh.services.common.wire import outputs
from vmesh.v1 import detokenizer_pb2, detokenizer_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

WORDS = (" The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", ",", " and", " then",
         " it", " runs", " away", ".", "\n", " Ü", "ber", " café", " 🦊", " \"quoted\"")


@dataclass
class Running:
    frontend_id: str
    prompt_tokens: int
    max_tokens: int
    produced: int = 0


@dataclass
class Upstream:
    """The scheduler and detokenizer a frontend sees: every submission runs; each step gives every
    running request one token (its text one of WORDS) until its max_tokens."""

    step_s: float
    running: dict[int, Running] = field(default_factory=dict)
    subscribers: dict[str, asyncio.Queue[detokenizer_pb2.SubscribeResponse]] = field(default_factory=dict)

    async def steps(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            by_frontend: dict[str, list[StreamOutput]] = {}
            for key, r in list(self.running.items()):
                token = r.produced % len(WORDS)
                r.produced += 1
                done = r.produced >= r.max_tokens
                by_frontend.setdefault(r.frontend_id, []).append(StreamOutput(
                    key, WORDS[token], [token], FinishReason.LENGTH if done else None, r.prompt_tokens,
                    r.produced, 0))
                if done:
                    del self.running[key]
            for frontend_id, outs in by_frontend.items():
                if (queue := self.subscribers.get(frontend_id)) is not None:
                    queue.put_nowait(outputs.to_proto(OutputBatch(outs)))


class StandInScheduler(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self, upstream: Upstream):
        self.upstream = upstream

    async def GetSchedulerStats(self, request: Any, context: Any) -> scheduler_pb2.GetSchedulerStatsResponse:
        return scheduler_pb2.GetSchedulerStatsResponse(model_name=EMBEDDED_MODEL_NAME, max_model_len=8192,
                                                       vocab_size=49152, incarnation="stand-in")

    async def SubmitRequest(self, request: Any, context: Any) -> scheduler_pb2.SubmitRequestResponse:
        self.upstream.running[request.frontend_key] = Running(request.frontend_id, len(request.prompt_token_ids),
                                                              request.sampling.max_tokens)
        return scheduler_pb2.SubmitRequestResponse(detokenizer=request.detokenizers[0])

    async def AbortRequest(self, request: Any, context: Any) -> scheduler_pb2.AbortRequestResponse:
        self.upstream.running.pop(request.frontend_key, None)
        return scheduler_pb2.AbortRequestResponse()

    async def WatchCache(self, request: Any, context: Any) -> AsyncIterator[scheduler_pb2.CacheUpdate]:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "no cache stream")  # routing by the frontend's table
        yield scheduler_pb2.CacheUpdate()  # pragma: no cover


class StandInDetokenizer(detokenizer_pb2_grpc.DetokenizerServiceServicer):
    def __init__(self, upstream: Upstream):
        self.upstream = upstream

    async def Subscribe(self, request: Any, context: Any) -> AsyncIterator[detokenizer_pb2.SubscribeResponse]:
        queue: asyncio.Queue[detokenizer_pb2.SubscribeResponse] = asyncio.Queue()
        self.upstream.subscribers[request.frontend_id] = queue
        await context.send_initial_metadata(())
        while True:
            yield await queue.get()


async def serve_upstream(upstream: Upstream) -> tuple[list[grpc.aio.Server], str, str]:
    """The stand-in scheduler's and detokenizer's servers (kept referenced: a dropped one stops) and addresses."""
    servers = []
    for add in (lambda s: scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(StandInScheduler(upstream), s),
                lambda s: detokenizer_pb2_grpc.add_DetokenizerServiceServicer_to_server(StandInDetokenizer(upstream),
                                                                                         s)):
        server = grpc.aio.server(options=SERVER_OPTIONS)
        add(server)
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append((server, f"127.0.0.1:{port}"))
    return [server for server, _ in servers], servers[0][1], servers[1][1]


@contextlib.contextmanager
def frontend_process(tree: Path, scheduler: str, detokenizer: str, profile: str | None) -> Iterator[
        tuple[subprocess.Popen, str]]:
    """`vmesh frontend` from `tree`; its pid and HTTP base URL once it serves."""
    ready = Path(tempfile.mkdtemp(prefix="vmesh-fe-")) / "ready"
    profiled = ["-m", "cProfile", "-o", profile] if profile else []
    log_level = os.environ.get("VMESH_BENCH_LOG_LEVEL", "WARNING")
    command = [sys.executable, *profiled, "-m", "vmesh", "--log-level", log_level, "frontend", "--port", "0",
               "--http-port", "0", "--scheduler", scheduler, "--detokenizer-addresses", detokenizer,
               "--ready-file", str(ready)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    process = subprocess.Popen(command, cwd=tree, env=env)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the frontend from {tree} did not start")
            time.sleep(0.05)
        http = Path(f"{ready}.http").read_text().strip()
        yield process, f"http://{http}/v1"
    finally:
        process.send_signal(signal.SIGINT if profile else signal.SIGTERM)  # cProfile writes its file on SIGINT
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_by_thread(pid: int) -> dict[str, float]:
    """CPU seconds of each of the process's threads, summed by thread name."""
    spent: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            spent[name] = spent.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return spent


async def stream_chat(http: httpx.AsyncClient, base_url: str, i: int, max_tokens: int) -> tuple[str, int, int]:
    """One streamed chat completion: the text the client assembles, its output tokens (the usage's),
    and the SSE events read."""
    body = {"model": EMBEDDED_MODEL_NAME, "messages": [{"role": "user", "content": f"Tell me a story, number {i}."}],
            "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    pieces: list[str] = []
    tokens = events = 0
    async with http.stream("POST", f"{base_url}/chat/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events += 1
            chunk = json.loads(line[6:])
            for choice in chunk["choices"]:
                pieces.append(choice["delta"].get("content") or "")
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return "".join(pieces), tokens, events


async def burst(base_url: str, streams: int, max_tokens: int, pids: dict[str, int]) -> dict[str, Any]:
    """`streams` streamed chat completions at once; CPU seconds per output token of each pid."""
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        await stream_chat(http, base_url, -1, 4)  # warm-up: first-call costs paid
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        threads_before = {name: cpu_by_thread(pid) for name, pid in pids.items()}
        started = time.perf_counter()
        results = await asyncio.gather(*(stream_chat(http, base_url, i, max_tokens) for i in range(streams)))
        elapsed = time.perf_counter() - started
        after = {name: cpu_seconds(pid) for name, pid in pids.items()}
        threads = {name: {thread: spent - threads_before[name].get(thread, 0.0)
                          for thread, spent in cpu_by_thread(pid).items()} for name, pid in pids.items()}
    tokens = sum(r[1] for r in results)
    digest = hashlib.sha256("\x00".join(r[0] for r in results).encode()).hexdigest()[:16]
    return {"tokens": tokens, "events": sum(r[2] for r in results), "elapsed_s": elapsed, "text_digest": digest,
            "cpu_ms_per_token": {name: 1e3 * (after[name] - before[name]) / max(tokens, 1) for name in pids},
            "thread_cpu_s": {name: {thread: round(v, 3) for thread, v in spent.items() if v > 0}
                             for name, spent in threads.items()}}


async def isolated_round(tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    upstream = Upstream(args.step_ms / 1e3)
    servers, scheduler, detokenizer = await serve_upstream(upstream)
    stepping = asyncio.create_task(upstream.steps())
    try:
        loop = asyncio.get_running_loop()
        with frontend_process(tree, scheduler, detokenizer, args.profile) as (process, base_url):
            await loop.run_in_executor(None, wait_serving, base_url)
            sampler = None
            if args.py_spy:  # py-spy's collapsed stacks of the frontend over the burst (and its warm-up)
                sampler = subprocess.Popen(["py-spy", "record", "--pid", str(process.pid), "--rate", "1000",
                                            "--format", "raw", "--output", args.py_spy], stdout=subprocess.DEVNULL)
                await asyncio.sleep(1)
            try:
                return await burst(base_url, args.streams, args.max_tokens, {"frontend": process.pid})
            finally:
                if sampler is not None:
                    sampler.send_signal(signal.SIGINT)
                    sampler.wait()
    finally:
        stepping.cancel()
        for server in servers:
            await server.stop(None)


def wait_serving(base_url: str) -> None:
    deadline = time.monotonic() + 60
    while httpx.get(base_url.removesuffix("/v1") + "/health").status_code != 200:
        if time.monotonic() > deadline:
            raise RuntimeError("the frontend never became healthy")
        time.sleep(0.1)


def mesh_round(tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    mesh = start_mesh(cwd=tree, env={"PYTHONPATH": str(tree)})
    try:
        pids = {name: pid for name, (_, pid) in mesh.services.items()}
        return asyncio.run(burst(mesh.http_url.rstrip("/"), args.streams, args.max_tokens, pids))
    finally:
        mesh.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--step-ms", type=float, default=20.0, help="isolated: the stand-in's time per step")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mesh", action="store_true", help="vmesh serve (embedded model) instead of stand-ins")
    parser.add_argument("--baseline-ref", help="also run a worktree of this git ref, alternating rounds")
    parser.add_argument("--profile", help="isolated: cProfile the frontend into this file (last round's)")
    parser.add_argument("--py-spy", help="isolated: py-spy's collapsed stacks of the frontend into this file")
    parser.add_argument("--threads", action="store_true", help="also print each process's CPU by thread name")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rounds: dict[str, list[dict[str, Any]]] = {}
    with baseline_trees(args.baseline_ref) as by_name:
        for i in range(args.rounds):
            for name, tree in by_name.items():
                result = mesh_round(tree, args) if args.mesh else asyncio.run(isolated_round(tree, args))
                rounds.setdefault(name, []).append(result)
                per_token = ", ".join(f"{k} {v:.4f}" for k, v in sorted(result["cpu_ms_per_token"].items()))
                print(f"round {i + 1} {name}: {result['tokens']} tokens in {result['elapsed_s']:.2f} s, "
                      f"{result['events']} events, text {result['text_digest']}; CPU ms/token: {per_token}",
                      flush=True)
                if args.threads:
                    print(f"  CPU s by thread: {result['thread_cpu_s']}", flush=True)
    summary = {name: {service: statistics.median(r["cpu_ms_per_token"][service] for r in results)
                      for service in results[0]["cpu_ms_per_token"]} for name, results in rounds.items()}
    print("median CPU ms per output token:")
    for name, services in summary.items():
        print(f"  {name}: " + ", ".join(f"{k} {v:.4f}" for k, v in sorted(services.items())))
    if args.baseline_ref:
        base, this = summary[args.baseline_ref], summary["this"]
        print("  this / baseline: " + ", ".join(f"{k} {this[k] / base[k]:.2f}" for k in sorted(this) if base.get(k)))
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rounds": rounds,
                                        "median_cpu_ms_per_token": summary}, indent=1))


if __name__ == "__main__":
    main()
