"""`vmesh bench serving --workload hot-prefix`: worker groups and routing on a hot-prefix load.

A few long shared prefixes (the heads of the long workload's prompts), one of them behind a
large share of the requests, each followed by a short distinct question: the shape of RAG and of
agents sharing a system prompt. For every group count in `--groups` and every frontend routing in
`--routings`, a fresh `vmesh serve --data-parallel-size G --frontends F` takes the same Poisson
schedule, requests spread over its frontends in turn. Reported per run: throughput, TTFT p50/p99,
the prefix-cache hit rate (prompt tokens each request found cached when first admitted, its
`usage.cached_prompt_tokens`, over all prompt tokens) against the ideal (each prefix computed
once), and the requests each group finished (busiest over idlest).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from vmesh.services.bench.common import load_workload, machine, timed_outputs
from vmesh.services.bench.mesh import RunningMesh, start_mesh
from vmesh.services.bench.serving import serve_load, summarize
from vmesh.services.client import VmeshClient
from vmesh.services.common.model_loading import resolve_model_dir

HOT_PREFIX_WORKLOAD = "hot-prefix"
BLOCK_TOKENS = 16  # the scheduler's default block size (the benchmark's meshes keep it): a hit is whole blocks


def hot_prefix_workload(requests: int, prefixes: int, prefix_tokens: int, hot_share: float,
                        question_tokens: int, seed: int = 0) -> list[list[int]]:
    """`requests` prompts: prefix 0 behind `hot_share` of them, the others uniformly behind the rest."""
    long = load_workload("long", None, None)["prompts"]
    if prefixes > len(long):
        raise SystemExit(f"--prefixes: at most {len(long)} (the long workload's prompts)")
    if prefixes < 2:
        raise SystemExit("--prefixes: at least 2 (one hot, the others behind the rest)")
    rng = random.Random(seed)
    prompts = []
    for i in range(requests):
        prefix = 0 if rng.random() < hot_share else rng.randrange(1, prefixes)
        # A distinct question per request: a slice of the long prompts far past any prefix.
        source, chunk = long[i % len(long)], 1 + i // len(long)
        question = source[-(chunk + 1) * question_tokens:][:question_tokens]
        prompts.append(long[prefix][:prefix_tokens] + question)
    return prompts


def ideal_hit_rate(prompts: list[list[int]], prefix_tokens: int) -> float:
    """Cached prompt tokens over prompt tokens when each prefix's full blocks are computed once
    and found by every later request that shares it."""
    seen: set[tuple[int, ...]] = set()
    cached = 0
    for prompt in prompts:
        key = tuple(prompt[:prefix_tokens])
        if key in seen:
            cached += prefix_tokens // BLOCK_TOKENS * BLOCK_TOKENS
        seen.add(key)
    return cached / sum(len(p) for p in prompts)


async def timed_with_cache(client: VmeshClient, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """timed_request's figures, and the prompt tokens the request found cached (its usage)."""
    cached = [0]

    async def outputs() -> AsyncIterator[Any]:
        async for out in client.generate(token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
            if out.HasField("usage"):
                cached[0] = out.usage.cached_prompt_tokens
            yield out

    result = await timed_outputs(outputs(), lambda out: len(out.token_ids))
    return {**result, "prompt_tokens": len(prompt), "cached_tokens": cached[0]}


async def finished_per_group(mesh: RunningMesh) -> dict[str, int]:
    return {name: _finished_requests(mesh.metrics[name]) for name in sorted(mesh.metrics)
            if name.startswith("scheduler")}


def _finished_requests(metrics_url: str) -> int:
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == "vmesh:request_prompt_tokens":
            return int(sum(s.value for s in family.samples if s.name.endswith("_count")))
    return 0


async def _one_run(mesh: RunningMesh, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    addresses = [f.address for f in mesh.description.frontends] or [mesh.address]
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(VmeshClient(address)) for address in addresses]
        senders = [lambda prompt, max_tokens, c=c: timed_with_cache(c, prompt, max_tokens) for c in clients]
        before = await finished_per_group(mesh)
        results, elapsed = await serve_load([senders[i % len(senders)] for i in range(len(prompts))], prompts,
                                             args.max_tokens or 16, args.request_rate, args.max_concurrency,
                                             args.seed)
        after = await finished_per_group(mesh)
    finished = {name: after[name] - before.get(name, 0) for name in after}
    summary = summarize(results, elapsed, args)
    hit_rate = sum(r["cached_tokens"] for r in results) / sum(r["prompt_tokens"] for r in results)
    idlest = min(finished.values())
    return {**summary, "hit_rate": hit_rate, "finished_per_group": finished,
            "busiest_over_idlest": max(finished.values()) / idlest if idlest else float("inf")}


def serving_groups(args: argparse.Namespace) -> dict[str, Any]:
    prompts = hot_prefix_workload(args.num_requests or 96, args.prefixes, args.prefix_tokens, args.hot_share,
                                  args.question_tokens, args.seed)
    groups = [int(g) for g in args.groups.split(",")]
    routings = args.routings.split(",")
    model = str(resolve_model_dir(args.model))
    runs = []
    for count in groups:
        for routing in routings if count > 1 else routings[:1]:  # one group: routing has no choice
            mesh = start_mesh("--model", model, "--kv-cache-memory", args.kv_cache_memory, "--metrics",
                              "--data-parallel-size", str(count), "--frontends", str(args.frontends),
                              "--routing", routing)
            try:
                figures = asyncio.run(_one_run(mesh, prompts, args))
            finally:
                mesh.stop()
            runs.append({"groups": count, "routing": routing, **figures})
            print(f"{count} group(s), {routing:>12}: {figures['output_token_throughput']:6.1f} tokens/s, TTFT p50 "
                  f"{figures['ttft_ms']['p50']:7.0f} ms p99 {figures['ttft_ms']['p99']:7.0f} ms, hit rate "
                  f"{figures['hit_rate']:.3f}, requests per group {sorted(figures['finished_per_group'].values())}",
                  flush=True)
    return {"mode": "serving", "workload": HOT_PREFIX_WORKLOAD, **machine(), "requests": len(prompts),
            "prefixes": args.prefixes, "prefix_tokens": args.prefix_tokens, "hot_share": args.hot_share,
            "frontends": args.frontends, "kv_cache_memory_per_group": args.kv_cache_memory,
            "request_rate": args.request_rate, "max_concurrency": args.max_concurrency,
            "ideal_hit_rate": ideal_hit_rate(prompts, args.prefix_tokens), "runs": runs}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--groups", default="1,2,3", help=f"--workload {HOT_PREFIX_WORKLOAD}: worker group counts, "
                                                          "a fresh mesh each")
    parser.add_argument("--routings", default="prefix,prefix-table",
                        help=f"--workload {HOT_PREFIX_WORKLOAD}: the frontends' --routing values to compare")
    parser.add_argument("--frontends", type=int, default=2, help=f"--workload {HOT_PREFIX_WORKLOAD}: frontends")
    parser.add_argument("--prefixes", type=int, default=12, help=f"--workload {HOT_PREFIX_WORKLOAD}: shared prefixes")
    parser.add_argument("--prefix-tokens", type=int, default=192)
    parser.add_argument("--hot-share", type=float, default=0.4, help="the share of requests behind prefix 0")
    parser.add_argument("--question-tokens", type=int, default=16)
