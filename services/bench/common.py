"""What every `vmesh bench` mode shares: the standard workload, the machine's description,
percentiles, results on disk, and timed requests against a running mesh."""

from __future__ import annotations

import asyncio
import itertools
import json
import platform
import statistics
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from vmesh.services.bench.mesh import RunningMesh
from vmesh.services.client import VmeshClient
from vmesh.services.common.types import OutputMode
from vmesh.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc

# The workloads that ship with vmesh; `--workload` takes these names or a file of the same form.
WORKLOADS = {"standard": Path(__file__).resolve().parent / "standard-64x128.json",
             "long": Path(__file__).resolve().parent / "long-16x2000.json",
             # Outputs that repeat their prompts (rewrite, quote, copy): where speculative decoding pays.
             "overlap": Path(__file__).resolve().parent / "overlap-64x128.json",
             # The online bench's shape offline: 64 distinct 256-token prompts, 128 tokens each.
             "medium": Path(__file__).resolve().parent / "long-64x256.json"}
_CHECKOUT_RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
# In a checkout the figures land beside benchmarks/README.md; installed, in the working directory.
RESULTS = _CHECKOUT_RESULTS if _CHECKOUT_RESULTS.parent.is_dir() else Path("vmesh-bench-results")


def load_workload(workload: str | Path, requests: int | None, max_tokens: int | None) -> dict[str, Any]:
    """A named workload (WORKLOADS) or a workload file: its first `requests` prompts."""
    path = WORKLOADS.get(str(workload), Path(workload))
    if not path.is_file():
        raise SystemExit(f"no workload {str(workload)!r}: name one of {sorted(WORKLOADS)} or a workload JSON file")
    data = json.loads(path.read_text())
    n = requests or data["n_requests"]
    return {"name": str(workload) if str(workload) in WORKLOADS else path.name, "path": path,
            "prompts": data["prompt_token_ids"][:n],
            "max_tokens": max_tokens or data["max_new_tokens"], "latency_prompt": data["latency_prompt_token_ids"]}


def for_model(work: dict[str, Any], model_dir: Path, embedded_dir: Path, scratch: Path) -> dict[str, Any]:
    """`work` for another model than the one its token ids come from: its prompts' text tokenized
    by `model_dir`'s tokenizer, written beside `scratch` (peers read the workload from a file)."""
    if model_dir == embedded_dir:
        return work
    data = json.loads(Path(work["path"]).read_text())
    if "prompts" not in data or "latency_prompt" not in data:
        raise SystemExit(f"workload {work['name']!r} holds token ids only: it cannot be tokenized for {model_dir.name}")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    n = len(work["prompts"])
    data["prompt_token_ids"] = [tokenizer.encode(text) for text in data["prompts"][:n]]
    data["latency_prompt_token_ids"] = tokenizer.encode(data["latency_prompt"])
    data["n_requests"] = n
    data["description"] = f"{data['description']} Tokenized for {model_dir.name}."
    path = scratch / Path(work["path"]).name
    path.write_text(json.dumps(data))
    return {**work, "path": path, "prompts": data["prompt_token_ids"],
            "latency_prompt": data["latency_prompt_token_ids"]}


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
    return await timed_outputs(client.generate(token_ids=prompt, max_tokens=max_tokens, temperature=0.0,
                                               ignore_eos=True), lambda out: len(out.token_ids))


async def timed_outputs(outputs: AsyncIterator[Any], tokens_of: Callable[[Any], int]) -> dict[str, Any]:
    """timed_request's figures for a stream of outputs, each carrying `tokens_of(output)` new tokens."""
    started = time.perf_counter()
    arrivals: list[tuple[float, int]] = []
    async for out in outputs:
        if n := tokens_of(out):
            arrivals.append((time.perf_counter(), n))
    end = time.perf_counter()
    tokens = sum(n for _, n in arrivals)
    ttft = arrivals[0][0] - started if arrivals else end - started
    # A response that merged n tokens spreads its gap over them.
    gaps = [(b - a) / n for (a, _), (b, n) in itertools.pairwise(arrivals)]
    tpot = (end - started - ttft) / max(tokens - 1, 1)
    return {"ttft": ttft, "itl": gaps, "tpot": tpot, "e2e": end - started, "tokens": tokens}


async def reset_prefix_cache(mesh: RunningMesh) -> None:
    async with mesh.channel("scheduler") as ch:
        await scheduler_pb2_grpc.SchedulerServiceStub(ch).ResetPrefixCache(scheduler_pb2.ResetPrefixCacheRequest())


async def mesh_stats(mesh: RunningMesh) -> tuple[Any, Any]:
    async with mesh.channel("scheduler") as ch:
        s = await scheduler_pb2_grpc.SchedulerServiceStub(ch).GetSchedulerStats(
            scheduler_pb2.GetSchedulerStatsRequest())
    worker = "worker" if "worker" in mesh.services else "worker-rank0"  # a tensor-parallel group's rank 0
    async with mesh.channel(worker) as ch:
        w = await worker_pb2_grpc.WorkerServiceStub(ch).GetWorkerStats(worker_pb2.GetWorkerStatsRequest())
    return s, w


async def mesh_generate(mesh: RunningMesh, prompts: list[list[int]], max_tokens: int,
                        models: Sequence[str] = (), output_mode: OutputMode = OutputMode.DELTA) -> dict[str, float]:
    """`models`: the models (LoRA adapters) the requests name in turn; none: the base model."""
    async with VmeshClient(mesh.address) as client:
        await client.complete(token_ids=prompts[0], max_tokens=2, temperature=0)  # warm-up
        await reset_prefix_cache(mesh)  # every round starts cold
        s0, w0 = await mesh_stats(mesh)
        started = time.perf_counter()
        results = await asyncio.gather(*(client.complete(token_ids=p, max_tokens=max_tokens, temperature=0.0,
                                                         ignore_eos=True, model=models[i % len(models)] if models
                                                         else "", output_mode=output_mode.value)
                                         for i, p in enumerate(prompts)))
        elapsed = time.perf_counter() - started
        s1, w1 = await mesh_stats(mesh)
    assert all(len(ids) == max_tokens for _t, ids, _l in results)
    decode_steps = s1.decode_steps - s0.decode_steps
    wall = w1.wall_seconds - w0.wall_seconds
    return {"tokens_per_s": len(prompts) * max_tokens / elapsed,
            "duty_cycle": (w1.busy_seconds - w0.busy_seconds) / wall if wall else 0.0,
            "bytes_per_decode_step": (s1.decode_plan_bytes - s0.decode_plan_bytes) / max(decode_steps, 1),
            "decode_steps": decode_steps, "ms_per_step": elapsed * 1e3 / max(s1.steps - s0.steps, 1),
            "num_draft_tokens": s1.num_draft_tokens - s0.num_draft_tokens,
            "num_accepted_tokens": s1.num_accepted_tokens - s0.num_accepted_tokens}
