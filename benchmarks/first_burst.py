"""Why the first burst after start-up is the slowest round (issue 35): identical bursts, as
`vmesh bench online` sent them until its rounds drew their own prompts (vLLM's client draws its
random prompts from one seed, so every round repeated them), against fresh prompts per burst;
through the in-process engine, or with --mesh through `vmesh serve`'s worker.

Before the bursts it warms up as vLLM's client does: one request, then 8 at once, all of its
first prompt. Per burst: the CPU seconds and minor page faults of the worker (in-process: of
this process, nearly all of it the worker's threads), the prompt tokens the worker computed
(the rest came from the prefix cache), and CPU per output token over the later bursts' median.
With the same prompts every later burst finds them cached and computes 1/16 of the prefill:
that, not a start-up cost, made the first burst the slowest. With fresh prompts the ratio is ~1.

    nice -n 19 .venv/bin/python -m benchmarks.first_burst [--mesh] [--prompts same,fresh] \
        [--bursts 3] [--num-prompts 32] [--input-len 256] [--output-len 32] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import resource
import statistics
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from vmesh.services.bench.common import reset_prefix_cache
from vmesh.services.bench.mesh import RunningMesh, start_mesh
from vmesh.services.client import VmeshClient
from vmesh.services.common.types import SamplingParams
from vmesh.services.engine.llm import EngineConfig, LLMEngine, serving_scheduler_defaults
from vmesh.services.worker.config import WorkerConfig, parse_memory_size

WARM_UP_REQUESTS = 8  # vLLM's client's --num-warmups in `vmesh bench online`
VOCAB_SIZE = 49152  # the embedded model's

# prompts, max_tokens -> [(prompt tokens, cached prompt tokens, output tokens)] per request
Send = Callable[[list[list[int]], int], list[tuple[int, int, int]]]


def _own_cpu_and_faults() -> tuple[float, int]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime, usage.ru_minflt


def _process_cpu_and_faults(pid: int) -> tuple[float, int]:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # from field 3 (state) on
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), int(fields[7])


@contextlib.contextmanager
def engine_target(args: argparse.Namespace) -> Iterator[tuple[Send, Callable[[], tuple[float, int]],
                                                                 Callable[[], None]]]:
    engine = LLMEngine.from_config(EngineConfig(worker=WorkerConfig(  # scheduled as the mesh is
        dtype=args.dtype, kv_cache_memory=parse_memory_size(args.kv_cache_memory)), **serving_scheduler_defaults()))

    def send(prompts: list[list[int]], max_tokens: int) -> list[tuple[int, int, int]]:
        outputs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        return [(o.num_prompt_tokens, o.num_cached_prompt_tokens, len(o.token_ids)) for o in outputs]

    try:
        yield send, _own_cpu_and_faults, engine.reset_prefix_cache
    finally:
        engine.shutdown()


@contextlib.contextmanager
def mesh_target(args: argparse.Namespace) -> Iterator[tuple[Send, Callable[[], tuple[float, int]],
                                                               Callable[[], None]]]:
    mesh: RunningMesh = start_mesh("--kv-cache-memory", args.kv_cache_memory, "--dtype", args.dtype)
    worker = next(pid for name, (_address, pid) in mesh.services.items() if name.startswith("worker"))

    async def generate(prompts: list[list[int]], max_tokens: int) -> list[tuple[int, int, int]]:
        async with VmeshClient(mesh.address) as client:
            replies = await asyncio.gather(*(client.complete(token_ids=p, max_tokens=max_tokens, temperature=0.0,
                                                             ignore_eos=True) for p in prompts))
        return [(last.usage.prompt_tokens, last.usage.cached_prompt_tokens, len(ids)) for _text, ids, last in replies]

    try:
        yield (lambda prompts, max_tokens: asyncio.run(generate(prompts, max_tokens)),
               lambda: _process_cpu_and_faults(worker), lambda: asyncio.run(reset_prefix_cache(mesh)))
    finally:
        mesh.stop()


def _burst(send: Send, usage: Callable[[], tuple[float, int]], prompts: list[list[int]],
           output_len: int) -> dict[str, Any]:
    cpu, faults = usage()
    requests = send(prompts, output_len)
    cpu_after, faults_after = usage()
    output_tokens = sum(n for _prompt, _cached, n in requests)
    return {"cpu_s": cpu_after - cpu, "minor_faults": faults_after - faults, "output_tokens": output_tokens,
            "prompt_tokens_computed": sum(prompt - cached for prompt, cached, _n in requests),
            "cpu_ms_per_output_token": 1e3 * (cpu_after - cpu) / output_tokens}


def run(send: Send, usage: Callable[[], tuple[float, int]], same_prompts: bool,
        args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)

    def draw() -> list[list[int]]:
        return [[rng.randrange(VOCAB_SIZE) for _ in range(args.input_len)] for _ in range(args.num_prompts)]

    prompts = draw()
    _burst(send, usage, prompts[:1], args.output_len)
    _burst(send, usage, prompts[:1] * WARM_UP_REQUESTS, args.output_len)
    bursts = []
    for _ in range(args.bursts):
        bursts.append(_burst(send, usage, prompts, args.output_len))
        if not same_prompts:
            prompts = draw()
    later = statistics.median(b["cpu_ms_per_output_token"] for b in bursts[1:])
    return {"bursts": bursts, "first_over_later_cpu_per_token": bursts[0]["cpu_ms_per_output_token"] / later}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mesh", action="store_true", help="through `vmesh serve` (its worker's CPU and faults)")
    parser.add_argument("--prompts", default="same,fresh",
                        help="same: every burst repeats the first one's prompts; fresh: new prompts per burst")
    parser.add_argument("--bursts", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.bursts < 2:
        parser.error("--bursts: at least 2 (the first is compared with the later ones)")
    modes = args.prompts.split(",")
    if set(modes) - {"same", "fresh"}:
        parser.error(f"--prompts: {args.prompts!r} lists something other than same and fresh")
    results: dict[str, Any] = {"target": "mesh" if args.mesh else "engine", **vars(args)}
    with (mesh_target if args.mesh else engine_target)(args) as (send, usage, reset):
        for mode in modes:
            reset()  # each mode starts with an empty prefix cache
            results[mode] = run(send, usage, mode == "same", args)
            for number, burst in enumerate(results[mode]["bursts"], 1):
                print(f"{mode} burst {number}: {burst['cpu_s']:.2f} CPU s, {burst['minor_faults']} minor faults, "
                      f"{burst['prompt_tokens_computed']} prompt tokens computed, "
                      f"{burst['cpu_ms_per_output_token']:.2f} CPU ms per output token", flush=True)
            print(f"{mode}: first burst's CPU per token over the later ones' median: "
                  f"{results[mode]['first_over_later_cpu_per_token']:.3f}", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
