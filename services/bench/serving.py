"""`vmesh bench serving`: a Poisson load through vmesh's gRPC API or any OpenAI-compatible
server's /v1/completions, reported as TTFT / TPOT / ITL percentiles and goodput."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import shlex
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from vmesh.services.bench.common import load_workload, machine, percentiles, reset_prefix_cache, timed_request
from vmesh.services.bench.mesh import RunningMesh, start_mesh
from vmesh.services.bench.step_report import engine_sender, print_step_report, step_report, worker_timeline
from vmesh.services.client import VmeshClient
from vmesh.services.common.model_loading import resolve_model_dir


async def timed_openai_request(http: Any, base_url: str, model: str | None, prompt: list[int],
                               max_tokens: int) -> dict[str, Any]:
    """The same request as timed_request, through any OpenAI-compatible server's streamed
    /v1/completions (token-id prompt; `ignore_eos` is vLLM's extra, which vmesh shares)."""
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                            "stream": True, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    return await timed_openai_stream(http, f"{base_url}/completions", body, lambda choice: choice.get("text"))


async def timed_openai_stream(http: Any, url: str, body: dict[str, Any],
                              text_of: Callable[[dict[str, Any]], str | None]) -> dict[str, Any]:
    """Timings of one streamed OpenAI request (`text_of` reads a choice's text: completions' `text`,
    chat's `delta.content`), with the text and finish reason it ended with. Each chunk with text
    counts as one arrival, as vLLM's benchmark counts them; the token total is the usage's."""
    started = time.perf_counter()
    arrivals: list[float] = []
    tokens = 0
    pieces: list[str] = []
    finish_reason = None
    async with http.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                choice = chunk["choices"][0]
                if text := text_of(choice):
                    arrivals.append(time.perf_counter())
                    pieces.append(text)
                finish_reason = choice.get("finish_reason") or finish_reason
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    tokens = tokens or len(arrivals)
    ttft = arrivals[0] - started if arrivals else end - started
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    tpot = (end - started - ttft) / max(tokens - 1, 1)
    return {"ttft": ttft, "itl": gaps, "tpot": tpot, "e2e": end - started, "tokens": tokens,
            "text": "".join(pieces), "finish_reason": finish_reason}


@contextlib.asynccontextmanager
async def request_sender(backend: str, address: str | None, base_url: str | None, model: str | None):
    """An async function (prompt, max_tokens) -> timings, for one backend."""
    if backend == "grpc":
        assert address, "serving() checks that --backend grpc has an address"
        async with VmeshClient(address) as client:
            yield lambda prompt, max_tokens: timed_request(client, prompt, max_tokens)
        return
    import httpx

    assert base_url, "serving() checks that --backend openai has a base URL"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=None, limits=limits) as http:
        yield lambda prompt, max_tokens: timed_openai_request(http, base_url, model, prompt, max_tokens)


async def serve_load(senders: list[Callable[..., Any]], prompts: Sequence[Any], max_tokens: int, rate: float,
                     concurrency: int, seed: int) -> tuple[list[dict[str, Any]], float]:
    """One Poisson schedule over `prompts`; request i goes through senders[i] as (prompt, max_tokens)."""
    rng = random.Random(seed)
    gate = asyncio.Semaphore(concurrency)

    async def one(send: Callable[..., Any], prompt: list[int], delay: float) -> dict[str, Any]:
        await asyncio.sleep(delay)
        async with gate:
            return await send(prompt, max_tokens)

    delays, t = [], 0.0
    for _ in prompts:
        delays.append(t)
        t += rng.expovariate(rate) if rate > 0 else 0.0
    started = time.perf_counter()
    results = await asyncio.gather(*(one(s, p, d) for s, p, d in zip(senders, prompts, delays)))
    return results, time.perf_counter() - started


def cpu_seconds(mesh: RunningMesh | None) -> dict[str, float]:
    """User + system CPU seconds so far of each service of `mesh` and of this process (the
    load generator): what a path costs, beside what it takes in latency."""
    tick = os.sysconf("SC_CLK_TCK")
    spent = {"client": sum(os.times()[:2])}
    for name, (_address, pid) in (mesh.services.items() if mesh else ()):
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            spent[name] = (int(fields[11]) + int(fields[12])) / tick
    return spent


async def _serve_backends(backends: list[str], args: argparse.Namespace, work: dict[str, Any],
                          address: str | None, base_url: str | None,
                          mesh: RunningMesh | None) -> tuple[dict[str, list[dict[str, Any]]], float, dict[str, Any]]:
    """Each request of the one schedule goes through one of `backends`, balanced and shuffled
    (seeded): with more than one, they share every moment of the load, so what differs between
    their latencies is the path, not the machine's mood. Returns the results per backend, the
    elapsed time and, for a mesh we started, its step report (step_report)."""
    async with contextlib.AsyncExitStack() as stack:
        senders = {b: await stack.enter_async_context(request_sender(b, address, base_url, args.served_model))
                   for b in backends}
        for send in senders.values():
            await send(work["prompts"][0], 2)  # warm-up: connections open, first-call costs paid
        if mesh is not None:
            await reset_prefix_cache(mesh)  # every run starts cold on the same prompts
        prompts = work["prompts"]
        assignment = [backends[i % len(backends)] for i in range(len(prompts))]
        random.Random(args.seed + 1).shuffle(assignment)
        mark = (await worker_timeline(mesh))[0] if mesh is not None else 0
        before = cpu_seconds(mesh)
        results, elapsed = await serve_load([senders[b] for b in assignment], prompts, work["max_tokens"],
                                             args.request_rate, args.max_concurrency, args.seed)
        after = cpu_seconds(mesh)
        cpu = {name: after[name] - before[name] for name in before if name in after}
        report = step_report((await worker_timeline(mesh, mark))[1], elapsed, cpu) if mesh is not None else {}
    by_backend: dict[str, list[dict[str, Any]]] = {b: [] for b in backends}
    for backend, result in zip(assignment, results):
        by_backend[backend].append(result)
    return by_backend, elapsed, {"cpu": cpu, **report}


async def _serve_engine(args: argparse.Namespace, work: dict[str, Any]) -> tuple[list[dict[str, Any]], float,
                                                                                  dict[str, Any]]:
    """The same schedule through the in-process engine: the reference for the mesh's worker."""
    with engine_sender(resolve_model_dir(args.model), args.kv_cache_memory_bytes, args.dtype,
                       args.weights) as (send, timed):
        await send(work["prompts"][0], 2)
        mark = timed.timeline.steps
        before = sum(os.times()[:2])
        results, elapsed = await serve_load([send] * len(work["prompts"]), work["prompts"], work["max_tokens"],
                                            args.request_rate, args.max_concurrency, args.seed)
        cpu = {"engine": sum(os.times()[:2]) - before}
        report = step_report(timed.timeline.summary(mark), elapsed, cpu)
        for name in ("worker_waited_for_plan_ms", "worker_plan_wait_ms", "worker_plan_decode_ms",
                     "worker_result_encode_ms"):
            del report[name]  # its plans reach the thread as objects, with no transport between
        return results, elapsed, report


def summarize(results: list[dict[str, Any]], elapsed: float, args: argparse.Namespace) -> dict[str, Any]:
    ms = 1e3
    good = [r for r in results if r["ttft"] * ms <= args.slo_ttft_ms and r["tpot"] * ms <= args.slo_tpot_ms]
    tokens = sum(r["tokens"] for r in results)
    return {
        "num_requests": len(results), "duration_s": elapsed,
        "request_throughput": len(results) / elapsed, "output_token_throughput": tokens / elapsed,
        "ttft_ms": percentiles([r["ttft"] * ms for r in results]),
        "tpot_ms": percentiles([r["tpot"] * ms for r in results]),
        "itl_ms": percentiles([g * ms for r in results for g in r["itl"]]),
        "goodput_requests_per_s": len(good) / elapsed,
    }


def model_flags(args: argparse.Namespace) -> list[str]:
    """`vmesh serve`'s flags for the --dtype and --weights asked of the benchmark, if any: the
    mesh's and the engine reference's."""
    return [flag for name, value in (("dtype", args.dtype), ("weights", args.weights)) if value
            for flag in (f"--{name}", value)]


def mesh_only_flags(args: argparse.Namespace) -> list[str]:
    """--serve-flags: more of `vmesh serve`'s flags, for the mesh the benchmark starts only."""
    return shlex.split(args.serve_flags)


def serving(args: argparse.Namespace) -> dict[str, Any]:
    """The Poisson workload through each `--backend` in turn: vmesh's gRPC API, or any
    OpenAI-compatible server's /v1/completions (vmesh's own HTTP API, or vLLM's)."""
    work = load_workload(args.workload, args.num_requests, args.max_tokens)
    backends = (args.backend or "grpc").split(",")
    if unknown := set(backends) - {"grpc", "openai"}:
        raise SystemExit(f"vmesh bench serving: unknown --backend {', '.join(sorted(unknown))} (grpc, openai)")
    external = args.address or args.base_url
    if external and (model_flags(args) or mesh_only_flags(args)):
        raise SystemExit("vmesh bench serving: --dtype, --weights and --serve-flags configure a mesh it starts, "
                         "not a server given by --address or --base-url")
    args.served_model = args.model if args.base_url else None  # --model: a name for a server we did not start
    mesh = None if external else start_mesh("--model", str(resolve_model_dir(args.model)),
                                              "--kv-cache-memory", args.kv_cache_memory, *model_flags(args),
                                              *mesh_only_flags(args))
    address = args.address or (mesh.address if mesh else None)
    base_url = (args.base_url or (mesh.http_url if mesh else "")).rstrip("/")
    for backend in backends:
        if (backend == "grpc" and not address) or (backend == "openai" and not base_url):
            raise SystemExit(f"vmesh bench serving: --backend {backend} needs "
                             f"{'--address' if backend == 'grpc' else '--base-url'} when a server is given")
    runs = [backends] if args.interleave else [[b] for b in backends]
    summaries: dict[str, dict[str, Any]] = {}
    try:
        for run in runs:
            by_backend, elapsed, report = asyncio.run(_serve_backends(run, args, work, address, base_url, mesh))
            cpu = report.pop("cpu")
            for backend, results in by_backend.items():
                summaries[backend] = summarize(results, elapsed, args)
                if report:
                    summaries[backend]["steps"] = report
                if len(run) == 1:  # CPU cannot be told apart between interleaved backends
                    tokens = max(1, sum(r["tokens"] for r in results))
                    summaries[backend]["cpu_ms_per_token"] = {k: 1e3 * v / tokens for k, v in cpu.items()}
    finally:
        if mesh is not None:
            mesh.stop()
    if getattr(args, "engine_reference", False):  # after the mesh has stopped: the cores are the engine's
        results, elapsed, report = asyncio.run(_serve_engine(args, work))
        summaries["engine"] = {**summarize(results, elapsed, args), "steps": report}
        backends = [*backends, "engine"]
    result: dict[str, Any] = {"mode": "serving", **machine(), "request_rate": args.request_rate,
                              "dtype": args.dtype, "weights": args.weights,
                              "mesh_only_flags": mesh_only_flags(args),
                              "interleaved": bool(args.interleave and len(backends) > 1),
                              "max_concurrency": args.max_concurrency, "max_tokens": work["max_tokens"],
                              "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms}}
    if len(summaries) == 1:
        result.update(backend=backends[0], **summaries[backends[0]])
    else:
        result["backends"] = summaries
    for backend, summary in summaries.items():
        print(f"[{backend}] {summary['num_requests']} requests in {summary['duration_s']:.1f} s: "
              f"{summary['request_throughput']:.2f} req/s, {summary['output_token_throughput']:.1f} tokens/s, "
              f"goodput {summary['goodput_requests_per_s']:.2f} req/s")
        for name in ("ttft_ms", "tpot_ms", "itl_ms"):
            p = summary[name]
            print(f"{name:>8}: p50 {p['p50']:8.1f}  p90 {p['p90']:8.1f}  p99 {p['p99']:8.1f}")
        if cpu_per_token := summary.get("cpu_ms_per_token"):
            print("  CPU ms/token: " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(cpu_per_token.items())))
        if steps := summary.get("steps"):
            print_step_report(backend, steps)
    return result
