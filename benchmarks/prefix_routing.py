"""Prefix-aware routing against least-busy routing, two worker groups.

    python -m benchmarks.prefix_routing [--prefixes 6] [--prefix-tokens 512] [--per-prefix 6] [--rounds 2]

A workload whose prompts share a few long prefixes (each the head of one of the long workload's
prompts, followed by a short distinct question) runs through `vmesh serve --data-parallel-size 2`
with the frontend's `--routing least-busy` and then `--routing prefix`, in alternating rounds on
fresh meshes. Each group's KV cache holds only about half of the prefixes, so where a prefix's
requests land decides whether it is computed once or again and again. Reported per mode: the
prefix-cache hit rate (blocks found over blocks looked up, both schedulers), output tokens per
second and mean time to first token.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from typing import Any

from vmesh.services.bench.common import load_workload
from vmesh.services.bench.mesh import RunningMesh, start_mesh
from vmesh.services.client import VmeshClient
from vmesh.services.common.grpc_server import channel
from vmesh.v1 import scheduler_pb2, scheduler_pb2_grpc

MODES = ("least-busy", "prefix")


def workload(prefixes: int, prefix_tokens: int, per_prefix: int) -> list[list[int]]:
    long = load_workload("long", None, None)["prompts"]
    questions = [p[-24:] for p in long]  # distinct tails, as the "question" after each shared document
    prompts = [long[i][:prefix_tokens] + questions[(i + j) % len(questions)][:16]
               for i in range(prefixes) for j in range(per_prefix)]
    random.Random(0).shuffle(prompts)
    return prompts


async def scheduler_totals(mesh: RunningMesh) -> tuple[int, int]:
    hits = queries = 0
    for name, (address, _pid) in mesh.services.items():
        if name.startswith("scheduler"):
            async with channel(address, "scheduler") as ch:
                stats = await scheduler_pb2_grpc.SchedulerServiceStub(ch).GetSchedulerStats(
                    scheduler_pb2.GetSchedulerStatsRequest(), timeout=10)
            hits += stats.prefix_cache_hits
            queries += stats.prefix_cache_queries
    return hits, queries


async def run(mesh: RunningMesh, prompts: list[list[int]], max_tokens: int, concurrency: int) -> dict[str, float]:
    before = await scheduler_totals(mesh)
    gate = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []

    async def one(client: VmeshClient, prompt: list[int]) -> int:
        async with gate:
            started = time.perf_counter()
            tokens = 0
            async for out in client.generate(token_ids=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True):
                if out.token_ids and not tokens:
                    ttfts.append(time.perf_counter() - started)
                tokens += len(out.token_ids)
            return tokens

    async with VmeshClient(mesh.address) as client:
        started = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(client, p) for p in prompts)))
        elapsed = time.perf_counter() - started
    after = await scheduler_totals(mesh)
    hits, queries = after[0] - before[0], after[1] - before[1]
    return {"hit_rate": hits / queries if queries else 0.0, "tokens_per_s": tokens / elapsed,
            "mean_ttft_ms": statistics.fmean(ttfts) * 1e3, "elapsed_s": elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefixes", type=int, default=6)
    parser.add_argument("--prefix-tokens", type=int, default=512)
    parser.add_argument("--per-prefix", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--kv-cache-memory", default="96MiB", help="per worker group: about half the prefixes")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/prefix_routing.json")
    args = parser.parse_args()
    prompts = workload(args.prefixes, args.prefix_tokens, args.per_prefix)
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:  # a fresh mesh each time: every round starts with cold caches
            mesh = start_mesh("--data-parallel-size", "2", "--routing", mode, "--kv-cache-memory", args.kv_cache_memory)
            try:
                results[mode].append(asyncio.run(run(mesh, prompts, args.max_tokens, args.concurrency)))
            finally:
                mesh.stop()
            print(mode, json.dumps(results[mode][-1]), flush=True)
    summary: dict[str, Any] = {
        "command": "python -m benchmarks.prefix_routing " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "requests": len(prompts), "runs": results,
        "median": {mode: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for mode, runs in results.items()}}
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=2)
    for mode, median in summary["median"].items():
        print(f"{mode:>10}: hit rate {median['hit_rate']:.2f}, {median['tokens_per_s']:.1f} output tokens/s, "
              f"mean TTFT {median['mean_ttft_ms']:.0f} ms")


if __name__ == "__main__":
    main()
