"""A LoRA worker's step time against the base model's, on one runner in one process.

One runner holds four seeded random rank-16 adapters on every projection (services/bench/lora.py);
each timed step runs a batch of B requests (decode: one token each over PROMPT_LEN cached ones;
prefill: PROMPT_LEN tokens each) with every row on the base model, the rows spread over the four
adapters in turn, or every row on one adapter. Rounds alternate the three, so drift reaches each;
each figure is the least disturbed round's (the fastest), which a busy machine shifts least.

    .venv/bin/python -m benchmarks.lora_step [--batch-sizes 1 16 64] [--phases decode prefill] [--steps 10]
        [--rounds 3] [--profile]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from vmesh.services.bench.lora import NUM_ADAPTERS, lora_flags, write_random_adapters
from vmesh.services.common.model_loading import resolve_model_dir
from vmesh.services.common.step_types import NewRequest, StepPlan
from vmesh.services.common.types import SamplingParams
from vmesh.services.worker.model_runner import ModelRunner, WorkerConfig

PROMPT_LEN = 64
MIXES = ("base", "mixed", "one")


def adapter_names(mix: str, batch: int) -> list[str]:
    if mix == "base":
        return [""] * batch
    if mix == "one":
        return ["lora-0"] * batch
    return [f"lora-{i % NUM_ADAPTERS}" for i in range(batch)]


def timed_steps(runner: ModelRunner, names: list[str], steps: int, prefill: bool) -> float:
    """Seconds per step: decode steps after one prefill, or `steps` prefills of fresh requests."""
    batch = len(names)
    block = runner.kv_cache.block_size
    blocks_per_req = -(-(PROMPT_LEN + steps + 2) // block)
    params = SamplingParams(temperature=0, max_tokens=steps + 4)
    step = runner.last_step + 1
    elapsed = 0.0
    for attempt in range(steps if prefill else 1):
        handles = list(range(batch * attempt, batch * (attempt + 1)))
        plan = StepPlan(step=step)
        for i, (handle, name) in enumerate(zip(handles, names)):
            tokens = [(7 * i + j + attempt) % 1000 + 1 for j in range(PROMPT_LEN)]
            plan.new_requests.append(NewRequest(handle, tokens, PROMPT_LEN, params,
                                                list(range(i * blocks_per_req, (i + 1) * blocks_per_req)),
                                                lora_name=name))
        plan.scheduled_handles, plan.num_scheduled_tokens = list(handles), [PROMPT_LEN] * batch
        started = time.perf_counter()
        runner.execute(plan)
        elapsed += time.perf_counter() - started
        step += 1
        if not prefill:
            runner.execute(StepPlan(step, scheduled_handles=list(handles), num_scheduled_tokens=[1] * batch))
            started = time.perf_counter()
            for s in range(steps):
                runner.execute(StepPlan(step + 1 + s, scheduled_handles=list(handles),
                                        num_scheduled_tokens=[1] * batch))
            elapsed = time.perf_counter() - started
            step += 1 + steps
        runner.execute(StepPlan(step, removed_handles=list(handles)))
        step += 1
    return elapsed / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--phases", nargs="+", choices=["decode", "prefill"], default=["decode", "prefill"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--profile", action="store_true", help="print torch.profiler's table of one mixed decode run")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(None)
    with tempfile.TemporaryDirectory() as out:
        paths = write_random_adapters(model_dir, Path(out))
        flags = lora_flags(paths)
        runner = ModelRunner.load(WorkerConfig(model=str(model_dir), kv_cache_memory=1 << 30, max_num_seqs=64,
                                               lora_modules=flags[1].split(","), max_loras=NUM_ADAPTERS))
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            timed_steps(runner, adapter_names("mixed", args.batch_sizes[-1]), args.steps, prefill=False)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        return
    results = {}
    for phase in args.phases:
        for batch in args.batch_sizes:
            times: dict[str, list[float]] = {mix: [] for mix in MIXES}
            for _ in range(args.rounds):
                for mix in MIXES:
                    times[mix].append(timed_steps(runner, adapter_names(mix, batch), args.steps, phase == "prefill"))
            ms = {mix: min(t) * 1e3 for mix, t in times.items()}
            results[f"{phase} B={batch}"] = {**{f"{m}_ms": round(v, 2) for m, v in ms.items()},
                                             "mixed_ratio": round(ms["base"] / ms["mixed"], 3),
                                             "one_ratio": round(ms["base"] / ms["one"], 3)}
            print(f"{phase} B={batch}: {results[f'{phase} B={batch}']}", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
