"""`vmesh bench`: the standard workload, baselines side by side, and the seed's claims.

    vmesh bench offline  [--baselines transformers,engine,mesh] [--requests 64] [--max-tokens 128] [--repeats 1]
    vmesh bench serving  [--address A] [--request-rate 4] [--max-concurrency 64] [--num-requests 64]
                         [--backend grpc|openai|grpc,openai] [--base-url http://HOST:PORT/v1] [--model NAME]
    vmesh bench claims   [--models embedded,tiny]
    vmesh bench detokenizer [--replicas 1 2]

Every mode prints a table and writes JSON to benchmarks/results/<mode>.json. Baselines run in
the same invocation, on the same prompts (token ids from the workload file).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import platform
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks.memory import PeakPss
from services.client import VmeshClient
from services.common.grpc_server import channel
from services.common.model_loading import resolve_model_dir
from services.common.sampling_params import SamplingParams
from services.mesh_process import RunningMesh, start_mesh
from vmesh.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc

BENCH_DIR = Path(__file__).resolve().parent
WORKLOAD = BENCH_DIR / "standard-64x128.json"
RESULTS = BENCH_DIR / "results"


# --- shared pieces -----------------------------------------------------------------------------

def load_workload(path: Path, requests: int | None, max_tokens: int | None) -> dict[str, Any]:
    workload = json.loads(Path(path).read_text())
    n = requests or workload["n_requests"]
    return {"prompts": workload["prompt_token_ids"][:n], "max_tokens": max_tokens or workload["max_new_tokens"],
            "latency_prompt": workload["latency_prompt_token_ids"]}


def machine() -> dict[str, Any]:
    return {"machine": platform.machine(), "processor": platform.processor(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d")}


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "mean": statistics.fmean(values)}


def save(mode: str, result: dict[str, Any], out_dir: Path = RESULTS) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{mode}.json"
    path.write_text(json.dumps(result, indent=1))
    return path


async def timed_request(client: VmeshClient, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed greedy request: TTFT, inter-token gaps, end-to-end, tokens."""
    started = time.perf_counter()
    arrivals: list[tuple[float, int]] = []
    async for out in client.generate(token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
        if out.token_ids:
            arrivals.append((time.perf_counter(), len(out.token_ids)))
    end = time.perf_counter()
    tokens = sum(n for _, n in arrivals)
    ttft = arrivals[0][0] - started if arrivals else end - started
    # A response that merged n tokens spreads its gap over them.
    gaps = [(b - a) / n for (a, _), (b, n) in itertools.pairwise(arrivals)]
    tpot = (end - started - ttft) / max(tokens - 1, 1)
    return {"ttft": ttft, "itl": gaps, "tpot": tpot, "e2e": end - started, "tokens": tokens}


async def reset_prefix_cache(mesh: RunningMesh) -> None:
    async with channel(mesh.services["scheduler"][0], "scheduler") as ch:
        await scheduler_pb2_grpc.SchedulerServiceStub(ch).ResetPrefixCache(scheduler_pb2.ResetPrefixCacheRequest())


async def mesh_stats(mesh: RunningMesh) -> tuple[Any, Any]:
    async with channel(mesh.services["scheduler"][0], "scheduler") as ch:
        s = await scheduler_pb2_grpc.SchedulerServiceStub(ch).GetSchedulerStats(
            scheduler_pb2.GetSchedulerStatsRequest())
    async with channel(mesh.services["worker"][0], "worker") as ch:
        w = await worker_pb2_grpc.WorkerServiceStub(ch).GetWorkerStats(worker_pb2.GetWorkerStatsRequest())
    return s, w


# --- offline -----------------------------------------------------------------------------------

def transformers_generate(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> Callable[[], float]:
    """Loads the model once; each call of the result is one timed batched `generate` (tokens/s)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True).eval()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left-padded
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    config = GenerationConfig(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)

    def run() -> float:
        with torch.inference_mode():
            started = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, generation_config=config)
            elapsed = time.perf_counter() - started
        assert out.shape[1] - width == max_tokens
        return len(prompts) * max_tokens / elapsed

    return run


@contextlib.contextmanager
def engine_generate(model_dir: Path, prompts: list[list[int]], max_tokens: int, depth: int = 2,
                    kv_cache_memory: int = 1 << 30) -> Iterator[Callable[[], float]]:
    """An in-process engine, warmed up; each call of the yielded function is one timed run."""
    from services.engine.llm import EngineConfig, LLMEngine
    from services.worker.model_runner import WorkerConfig

    engine = LLMEngine.from_config(EngineConfig(worker=WorkerConfig(model=str(model_dir), max_num_seqs=256,
                                                                    kv_cache_memory=kv_cache_memory),
                                                pipeline_depth=depth))

    def run() -> float:
        engine.reset_prefix_cache()  # every round starts cold, as the first one does
        started = time.perf_counter()
        outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        elapsed = time.perf_counter() - started
        assert all(len(o.token_ids) == max_tokens for o in outs)
        return len(prompts) * max_tokens / elapsed

    try:
        engine.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2))  # warm-up
        yield run
    finally:
        engine.shutdown()


async def mesh_generate(mesh: RunningMesh, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    async with VmeshClient(mesh.address) as client:
        await client.complete(token_ids=prompts[0], max_tokens=2, temperature=0)  # warm-up
        await reset_prefix_cache(mesh)  # every round starts cold
        s0, w0 = await mesh_stats(mesh)
        started = time.perf_counter()
        results = await asyncio.gather(*(client.complete(token_ids=p, max_tokens=max_tokens, temperature=0.0,
                                                         ignore_eos=True) for p in prompts))
        elapsed = time.perf_counter() - started
        s1, w1 = await mesh_stats(mesh)
    assert all(len(ids) == max_tokens for _t, ids, _l in results)
    decode_steps = s1.decode_steps - s0.decode_steps
    wall = w1.wall_seconds - w0.wall_seconds
    return {"tokens_per_s": len(prompts) * max_tokens / elapsed,
            "duty_cycle": (w1.busy_seconds - w0.busy_seconds) / wall if wall else 0.0,
            "bytes_per_decode_step": (s1.decode_plan_bytes - s0.decode_plan_bytes) / max(decode_steps, 1),
            "decode_steps": decode_steps}


async def mesh_latency(mesh: RunningMesh, prompt: list[int], max_tokens: int) -> dict[str, float]:
    async with VmeshClient(mesh.address) as client:
        await client.complete(token_ids=prompt, max_tokens=2, temperature=0)  # warm-up
        r = await timed_request(client, prompt, max_tokens)
    return {"ttft_ms": r["ttft"] * 1e3, "mean_itl_ms": statistics.fmean(r["itl"]) * 1e3 if r["itl"] else 0.0}


def offline(args: argparse.Namespace) -> dict[str, Any]:
    """Each baseline loads once; then `--repeats` rounds run transformers, engine and mesh in
    turn, so that the machine's drift (runs here vary by ~10 %) reaches all three alike. The
    figures reported are each run's median over the rounds."""
    work = load_workload(args.workload, args.requests, args.max_tokens)
    model_dir = resolve_model_dir(args.model)
    baselines = set(args.baselines.split(","))
    result: dict[str, Any] = {"mode": "offline", "requests": len(work["prompts"]), "max_tokens": work["max_tokens"],
                              "repeats": args.repeats, **machine(), "tokens_per_s": {}, "runs_tokens_per_s": {}}
    runs: dict[str, Callable[[], float]] = {}
    with contextlib.ExitStack() as stack:
        if "transformers" in baselines:
            runs["transformers"] = transformers_generate(model_dir, work["prompts"], work["max_tokens"])
        if "engine" in baselines:
            runs["engine"] = stack.enter_context(engine_generate(model_dir, work["prompts"], work["max_tokens"],
                                                                 kv_cache_memory=args.kv_cache_memory_bytes))
        mesh = start_mesh("--model", str(model_dir), "--kv-cache-memory", args.kv_cache_memory)
        stack.callback(mesh.stop)
        mesh_runs: list[dict[str, float]] = []

        def run_mesh() -> float:
            mesh_runs.append(asyncio.run(mesh_generate(mesh, work["prompts"], work["max_tokens"])))
            return mesh_runs[-1]["tokens_per_s"]

        runs["mesh"] = run_mesh
        for name in runs:
            result["runs_tokens_per_s"][name] = []
        with PeakPss({name: pid for name, (_address, pid) in mesh.services.items()}) as peaks:
            for _ in range(args.repeats):
                for name, run in runs.items():
                    result["runs_tokens_per_s"][name].append(run())
        result["mesh_peak_pss_mib"] = peaks.mib
        result["mesh_duty_cycle"] = statistics.median(r["duty_cycle"] for r in mesh_runs)
        result["latency"] = asyncio.run(mesh_latency(mesh, work["latency_prompt"], work["max_tokens"]))
    result["tokens_per_s"] = {name: statistics.median(v) for name, v in result["runs_tokens_per_s"].items()}
    mesh_tps = result["tokens_per_s"]["mesh"]
    result["ratio_to_mesh"] = {k: v / mesh_tps for k, v in result["tokens_per_s"].items()}
    label = "tokens/s" if args.repeats == 1 else "median"
    print(f"{'run':>14} {label:>9} {'x mesh':>7}" + ("   every round" if args.repeats > 1 else ""))
    for name, tps in result["tokens_per_s"].items():
        rounds = "  ".join(f"{v:.1f}" for v in result["runs_tokens_per_s"][name]) if args.repeats > 1 else ""
        print(f"{name:>14} {tps:>9.1f} {tps / mesh_tps:>7.2f}   {rounds}")
    lat = result["latency"]
    print(f"single request through the mesh: TTFT {lat['ttft_ms']:.0f} ms, mean ITL {lat['mean_itl_ms']:.1f} ms")
    memory = result["mesh_peak_pss_mib"]
    print("mesh peak PSS: " + ", ".join(f"{name} {mib:.0f} MiB" for name, mib in memory.items())
          + f"; all {sum(memory.values()):.0f} MiB")
    return result


# --- serving -----------------------------------------------------------------------------------

async def timed_openai_request(http: Any, base_url: str, model: str | None, prompt: list[int],
                               max_tokens: int) -> dict[str, Any]:
    """The same request as timed_request, through any OpenAI-compatible server's streamed
    /v1/completions (token-id prompt; `ignore_eos` is vLLM's extra, which vmesh shares). Each
    chunk counts as one arrival, as vLLM's benchmark counts them; the token total is the usage's."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    started = time.perf_counter()
    arrivals: list[float] = []
    tokens = 0
    async with http.stream("POST", f"{base_url}/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{base_url}: HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                arrivals.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    tokens = tokens or len(arrivals)
    ttft = arrivals[0] - started if arrivals else end - started
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    tpot = (end - started - ttft) / max(tokens - 1, 1)
    return {"ttft": ttft, "itl": gaps, "tpot": tpot, "e2e": end - started, "tokens": tokens}


@contextlib.asynccontextmanager
async def request_sender(backend: str, address: str | None, base_url: str | None, model: str | None):
    """An async function (prompt, max_tokens) -> timings, for one backend."""
    if backend == "grpc":
        async with VmeshClient(address) as client:
            yield lambda prompt, max_tokens: timed_request(client, prompt, max_tokens)
        return
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=None, limits=limits) as http:
        yield lambda prompt, max_tokens: timed_openai_request(http, base_url, model, prompt, max_tokens)


async def _serve_load(senders: list[Callable[..., Any]], prompts: list[list[int]], max_tokens: int, rate: float,
                      concurrency: int, seed: int) -> tuple[list[dict[str, Any]], float]:
    """One Poisson schedule over `prompts`; request i goes through senders[i]."""
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
                          mesh: RunningMesh | None) -> tuple[dict[str, list[dict[str, Any]]], float, dict[str, float]]:
    """Each request of the one schedule goes through one of `backends`, balanced and shuffled
    (seeded): with more than one, they share every moment of the load, so what differs between
    their latencies is the path, not the machine's mood. Returns the results per backend, the
    elapsed time and the CPU seconds each process spent."""
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
        before = cpu_seconds(mesh)
        results, elapsed = await _serve_load([senders[b] for b in assignment], prompts, work["max_tokens"],
                                             args.request_rate, args.max_concurrency, args.seed)
        after = cpu_seconds(mesh)
    by_backend: dict[str, list[dict[str, Any]]] = {b: [] for b in backends}
    for backend, result in zip(assignment, results):
        by_backend[backend].append(result)
    return by_backend, elapsed, {name: after[name] - before[name] for name in before if name in after}


def _summarize(results: list[dict[str, Any]], elapsed: float, args: argparse.Namespace) -> dict[str, Any]:
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


def serving(args: argparse.Namespace) -> dict[str, Any]:
    """The Poisson workload through each `--backend` in turn: vmesh's gRPC API, or any
    OpenAI-compatible server's /v1/completions (vmesh's own HTTP API, or vLLM's)."""
    work = load_workload(args.workload, args.num_requests, args.max_tokens)
    backends = args.backend.split(",")
    external = args.address or args.base_url
    args.served_model = args.model if args.base_url else None  # --model: a name for a server we did not start
    mesh = None if external else start_mesh("--model", str(resolve_model_dir(args.model)),
                                              "--kv-cache-memory", args.kv_cache_memory)
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
            by_backend, elapsed, cpu = asyncio.run(_serve_backends(run, args, work, address, base_url, mesh))
            for backend, results in by_backend.items():
                summaries[backend] = _summarize(results, elapsed, args)
                if len(run) == 1:  # CPU cannot be told apart between interleaved backends
                    tokens = sum(r["tokens"] for r in results)
                    summaries[backend]["cpu_ms_per_token"] = {k: 1e3 * v / tokens for k, v in cpu.items()}
    finally:
        if mesh is not None:
            mesh.stop()
    result: dict[str, Any] = {"mode": "serving", **machine(), "request_rate": args.request_rate,
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
        if cpu := summary.get("cpu_ms_per_token"):
            print("  CPU ms/token: " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(cpu.items())))
    return result


# --- the seed's claims -------------------------------------------------------------------------

def tiny_model_dir(target: Path) -> Path:
    """A 2-layer Llama over the embedded model's tokenizer: its forward pass is fast enough that
    per-step overhead dominates, as it does on a GPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    embedded = resolve_model_dir(None)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, eos_token_id=2, bos_token_id=1)
    LlamaForCausalLM(config).save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (embedded / name).exists():
            shutil.copy(embedded / name, target / name)
    return target


def claims(args: argparse.Namespace) -> dict[str, Any]:
    work = load_workload(args.workload, args.requests, args.max_tokens)
    result: dict[str, Any] = {"mode": "claims", **machine(), "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            model_dir = (tiny_model_dir(Path(tmp) / "tiny") if model == "tiny"
                         else resolve_model_dir(args.model))
            rows = {}
            for depth in (1, 2):
                for stateless in (False, True):
                    name = f"depth{depth}-{'stateless' if stateless else 'stateful'}"
                    flags = ["--model", str(model_dir), "--pipeline-depth", str(depth),
                             "--kv-cache-memory", args.kv_cache_memory]
                    flags += ["--stateless-worker"] if stateless else []
                    mesh = start_mesh(*flags)
                    try:
                        rows[name] = asyncio.run(mesh_generate(mesh, work["prompts"], work["max_tokens"]))
                    finally:
                        mesh.stop()
            result["models"][model] = {
                "modes": rows,
                "duty_cycle_async_over_sync": (rows["depth2-stateful"]["duty_cycle"]
                                               / rows["depth1-stateful"]["duty_cycle"]),
                "bytes_stateless_over_stateful": (rows["depth2-stateless"]["bytes_per_decode_step"]
                                                  / rows["depth2-stateful"]["bytes_per_decode_step"]),
                "tokens_per_s_async_over_sync": (rows["depth2-stateful"]["tokens_per_s"]
                                                 / rows["depth1-stateful"]["tokens_per_s"]),
            }
    for model, m in result["models"].items():
        print(f"\n{model}: {'mode':>18} {'tok/s':>8} {'duty':>6} {'bytes/step':>11}")
        for name, r in m["modes"].items():
            print(f"{'':>{len(model) + 1}} {name:>18} {r['tokens_per_s']:>8.1f} {r['duty_cycle']:>6.3f} "
                  f"{r['bytes_per_decode_step']:>11.0f}")
        print(f"  duty cycle async/sync {m['duty_cycle_async_over_sync']:.3f}; throughput async/sync "
              f"{m['tokens_per_s_async_over_sync']:.2f}; "
              f"bytes stateless/stateful {m['bytes_stateless_over_stateful']:.1f}")
    return result


# --- detokenizer throughput --------------------------------------------------------------------

async def _detokenizer_throughput(replicas: int, prompts: list[list[int]], max_tokens: int) -> float:
    """Push one engine step of token ids at a time through `replicas` detokenizer processes,
    requests spread evenly, and count the tokens a subscribed frontend receives."""
    import subprocess
    import sys

    from services.common.grpc_server import wait_until_serving
    from services.common.wire import sampling_to_proto
    from vmesh.v1 import common_pb2, detokenizer_pb2, detokenizer_pb2_grpc

    with tempfile.TemporaryDirectory() as tmp:
        procs, addresses = [], []
        for i in range(replicas):
            ready = Path(tmp) / f"d{i}"
            procs.append(subprocess.Popen([sys.executable, "-m", "services.cli", "--log-level", "WARNING",
                                           "detokenizer", "--port", "0", "--ready-file", str(ready)]))
            while not ready.exists():
                await asyncio.sleep(0.05)
            addresses.append(ready.read_text())
        try:
            for a in addresses:
                await wait_until_serving(a, 120)
            channels = [channel(a, "detokenizer") for a in addresses]
            stubs = [detokenizer_pb2_grpc.DetokenizerServiceStub(c) for c in channels]
            subs = [s.Subscribe(detokenizer_pb2.SubscribeRequest(frontend_id="bench")) for s in stubs]
            for sub in subs:
                await sub.initial_metadata()
            total = len(prompts) * max_tokens
            received = 0
            done = asyncio.Event()

            async def drain(sub) -> None:
                nonlocal received
                async for batch in sub:
                    received += sum(batch.num_tokens)
                    if received >= total:
                        done.set()

            readers = [asyncio.create_task(drain(s)) for s in subs]
            calls = [s.Detokenize() for s in stubs]
            params = sampling_to_proto(SamplingParams(max_tokens=max_tokens))
            started = time.perf_counter()
            for step in range(max_tokens):
                for r, call in enumerate(calls):
                    mine = range(r, len(prompts), replicas)
                    batch = detokenizer_pb2.DetokenizeRequest()
                    if step == 0:
                        batch.new_requests.extend(detokenizer_pb2.DetokenizerRequestInfo(
                            handle=h, frontend_id="bench", frontend_key=h, prompt_tail=prompts[h][-4:],
                            sampling=params, num_prompt_tokens=len(prompts[h])) for h in mine)
                    for h in mine:
                        batch.handles.append(h)
                        batch.num_tokens.append(1)
                        batch.token_ids.append(prompts[h][(step * 7) % len(prompts[h])])
                        last = step == max_tokens - 1
                        batch.finish_reasons.append(common_pb2.FINISH_REASON_LENGTH if last else 0)
                        batch.num_cached_prompt_tokens.append(0)
                        batch.errors.append("")
                    await call.write(batch)
            await asyncio.wait_for(done.wait(), 600)
            elapsed = time.perf_counter() - started
            for task in readers:
                task.cancel()
            for call in calls:
                call.cancel()
            for c in channels:
                await c.close()
            return total / elapsed
        finally:
            for p in procs:
                p.terminate()
                p.wait()


def detokenizer(args: argparse.Namespace) -> dict[str, Any]:
    work = load_workload(args.workload, args.requests, args.max_tokens)
    result = {"mode": "detokenizer", **machine(), "tokens_per_s": {}}
    for replicas in args.replicas:
        tps = asyncio.run(_detokenizer_throughput(replicas, work["prompts"], work["max_tokens"]))
        result["tokens_per_s"][str(replicas)] = tps
        print(f"{replicas} detokenizer replica(s): {tps:.0f} tokens/s")
    return result


# --- command line ------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vmesh bench", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--workload", type=Path, default=WORKLOAD)
    common.add_argument("--model", default=None, help="default: the embedded model")
    common.add_argument("--max-tokens", type=int, default=None, help="default: the workload's (128)")
    common.add_argument("--kv-cache-memory", default="1GiB")
    common.add_argument("--out", type=Path, default=RESULTS, help="where the JSON goes")
    off = sub.add_parser("offline", parents=[common])
    off.add_argument("--requests", type=int, default=None)
    off.add_argument("--baselines", default="transformers,engine,mesh")
    off.add_argument("--repeats", type=int, default=1, help="rounds of every run, in turn; medians are reported")
    srv = sub.add_parser("serving", parents=[common])
    srv.add_argument("--address", default=None, help="a running mesh's gRPC address (default: start a mesh)")
    srv.add_argument("--backend", default="grpc",
                     help="grpc (vmesh's API), openai (/v1/completions of --base-url or of the started mesh), "
                          "or both: grpc,openai (in turn, or mixed with --interleave)")
    srv.add_argument("--interleave", action="store_true",
                     help="with several backends: one load, each request through one of them (balanced, "
                          "shuffled), so that latencies are compared under the same conditions")
    srv.add_argument("--base-url", default=None,
                     help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1 (vmesh or vLLM); "
                          "--model is then the model name it serves")
    srv.add_argument("--num-requests", type=int, default=None)
    srv.add_argument("--request-rate", type=float, default=4.0, help="Poisson arrivals per second; 0: all at once")
    srv.add_argument("--max-concurrency", type=int, default=64)
    srv.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    srv.add_argument("--slo-tpot-ms", type=float, default=200.0)
    srv.add_argument("--seed", type=int, default=0)
    cl = sub.add_parser("claims", parents=[common])
    cl.add_argument("--requests", type=int, default=None)
    cl.add_argument("--models", default="embedded,tiny")
    det = sub.add_parser("detokenizer", parents=[common])
    det.add_argument("--requests", type=int, default=None)
    det.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    return parser


MODES = {"offline": offline, "serving": serving, "claims": claims, "detokenizer": detokenizer}


def main(argv: list[str] | None = None) -> int:
    from services.worker.kv_cache import parse_memory_size

    args = build_parser().parse_args(argv)
    args.kv_cache_memory_bytes = parse_memory_size(args.kv_cache_memory)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    result = MODES[args.mode](args)
    result["command"] = "vmesh bench " + " ".join(argv if argv is not None else __import__("sys").argv[1:])
    print(f"results: {save(args.mode, result, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
