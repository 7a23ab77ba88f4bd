"""Decode tokens/s of the model runner vs transformers' own forward on the same batch.

Each batch of B requests holds a prompt of PROMPT_LEN tokens already in the KV cache; one
timed step computes one new token per request (forward + sampling for vmesh, forward with a
DynamicCache for transformers, which then also holds PROMPT_LEN cached tokens).

    .venv/bin/python -m benchmarks.model_runner_decode [--batch-sizes 1 8 32 64] [--steps 10] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from vmesh.services.common.model_loading import resolve_model_dir
from vmesh.services.common.step_types import NewRequest, StepPlan
from vmesh.services.common.types import SamplingParams
from vmesh.services.worker.model_runner import ModelRunner, WorkerConfig

PROMPT_LEN = 128


def bench_vmesh(runner: ModelRunner, batch: int, steps: int) -> float:
    block = runner.kv_cache.block_size
    blocks_per_req = -(-(PROMPT_LEN + steps + 2) // block)
    step = runner.last_step + 1
    handles = list(range(10_000 * batch, 10_000 * batch + batch))
    params = SamplingParams(temperature=0, max_tokens=steps + 2)
    plan = StepPlan(step=step)
    for i, h in enumerate(handles):
        tokens = [(7 * i + j) % 1000 + 1 for j in range(PROMPT_LEN)]
        plan.new_requests.append(NewRequest(h, tokens, PROMPT_LEN, params,
                                            list(range(i * blocks_per_req, (i + 1) * blocks_per_req))))
    plan.scheduled_handles, plan.num_scheduled_tokens = list(handles), [PROMPT_LEN] * batch
    runner.execute(plan)
    runner.execute(StepPlan(step + 1, scheduled_handles=list(handles), num_scheduled_tokens=[1] * batch))  # warm
    started = time.perf_counter()
    for s in range(steps):
        runner.execute(StepPlan(step + 2 + s, scheduled_handles=list(handles), num_scheduled_tokens=[1] * batch))
    elapsed = time.perf_counter() - started
    runner.execute(StepPlan(step + 2 + steps, removed_handles=list(handles)))
    return batch * steps / elapsed


def bench_transformers(model, batch: int, steps: int) -> float:
    from transformers import DynamicCache

    ids = torch.tensor([[(7 * i + j) % 1000 + 1 for j in range(PROMPT_LEN)] for i in range(batch)])
    with torch.inference_mode():
        cache = DynamicCache()
        out = model(ids, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        out = model(token, past_key_values=cache, use_cache=True)  # warm
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        started = time.perf_counter()
        for _ in range(steps):
            out = model(token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
        elapsed = time.perf_counter() - started
    return batch * steps / elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per batch size; medians reported")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    model_dir = resolve_model_dir(None)
    runner = ModelRunner.load(WorkerConfig(model=str(model_dir), kv_cache_memory=1 << 30, max_num_seqs=64))
    reference = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True).eval()
    rows = []
    print(f"{'batch':>5} {'vmesh tok/s':>12} {'transformers tok/s':>19} {'ratio':>6}")
    for batch in args.batch_sizes:
        # Alternate the two so that drift in the machine's speed hits both alike.
        samples = []
        for r in range(args.rounds):  # and alternate which goes first, against order effects
            if r % 2:
                theirs_first = bench_transformers(reference, batch, args.steps)
                samples.append((bench_vmesh(runner, batch, args.steps), theirs_first))
            else:
                ours_first = bench_vmesh(runner, batch, args.steps)
                samples.append((ours_first, bench_transformers(reference, batch, args.steps)))
        ours = statistics.median(s[0] for s in samples)
        theirs = statistics.median(s[1] for s in samples)
        rows.append({"batch": batch, "vmesh_tokens_per_s": ours, "transformers_tokens_per_s": theirs,
                     "ratio": ours / theirs})
        print(f"{batch:>5} {ours:>12.1f} {theirs:>19.1f} {ours / theirs:>6.2f}")
    print(json.dumps({"machine": platform.machine(), "threads": args.threads, "prompt_len": PROMPT_LEN,
                      "torch": torch.__version__, "rows": rows}))


if __name__ == "__main__":
    main()
