"""Decode steps of the model runner alone in each weight mode of the embedded model (or of
`--model gemma3-270m`): `dequantized` (float32, oneDNN), `native-float` (today's float32 block
kernel), `native-int8` (int8 dot products over the blocks), `int8` (`--weights int8`) and
`native-before` (`--weights native` as it was before the kernels read Q5_0, Q4_K and Q6_K: linears
in those formats dequantized to float32 at load, the rest on int8 dot products). Every request
holds --context cached tokens; the modes alternate over --rounds rounds of --steps steps, the
minimum per step is kept. With --threads 1 the clock is the thread's CPU time (a shared machine's
descheduling does not count).

    .venv/bin/python -m benchmarks.int8_modes [--batches 1 64] [--context 128] [--rounds 3] [--threads 1]
        [--model gemma3-270m] [--modes native-before native-int8]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Iterator, Sequence
from unittest import mock

import torch

from benchmarks.native_quality import DEFAULT_MODES, MODES, load
from vmesh.services.common.model_loading import load_model_spec, resolve_model_dir
from vmesh.services.common.step_types import NewRequest, StepPlan
from vmesh.services.common.types import SamplingParams
from vmesh.services.worker.kv_cache import bytes_per_block
from vmesh.services.worker.model_runner import ModelRunner
from vmesh.services.worker.quantized_linear import QuantizedLinear, QuantizedWeight

# The block formats the native kernels read before Q5_0, Q4_K and Q6_K (GGML type ids Q4_0, Q4_1, Q8_0).
FORMATS_BEFORE = (2, 3, 8)


@contextlib.contextmanager
def formats_before_kquants() -> Iterator[None]:
    """Loads as `--weights native` did before: a linear with a part in another format is dequantized."""
    join = QuantizedWeight.join

    def join_before(parts: Sequence[torch.Tensor | QuantizedWeight]) -> QuantizedWeight | str:
        if any(isinstance(p, QuantizedWeight) and p.block_format not in FORMATS_BEFORE for p in parts):
            return "a format the kernels read only since Q5_0/Q4_K/Q6_K"
        return join(parts)

    with mock.patch.object(QuantizedWeight, "join", staticmethod(join_before)):
        yield


def prefilled(mode: str, batch: int, context: int, total_steps: int, model: str | None = None) -> ModelRunner:
    blocks_per_request = -(-(context + total_steps + 8) // 16)
    block_bytes = bytes_per_block(load_model_spec(resolve_model_dir(model)), 16, torch.float32)
    settings = dict(max_num_seqs=batch, block_size=16, kv_cache_memory=batch * blocks_per_request * block_bytes,
                    model=model)
    if mode == "native-before":
        with formats_before_kquants():
            runner = load("native-int8", **settings)
    else:
        runner = load(mode, **settings)
    params = SamplingParams(temperature=0, max_tokens=context + total_steps + 8, ignore_eos=True)
    plan = StepPlan(step=0, scheduled_handles=list(range(batch)), num_scheduled_tokens=[context] * batch)
    # A sliding-window model's KV cache groups (Gemma 3: 6) each take a table; blocks hold one
    # group's layers, so the memory above holds that many times the blocks.
    per_request = blocks_per_request * runner.kv_cache.num_groups
    for i in range(batch):
        prompt = [(7 * i + j) % 1000 + 1 for j in range(context)]
        plan.new_requests.append(NewRequest(i, prompt, context, params,
                                            list(range(i * per_request, (i + 1) * per_request))))
    runner.execute(plan)
    return runner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--modes", nargs="+", default=DEFAULT_MODES, choices=[*MODES, "native-before"])
    parser.add_argument("--model", default=None, help="a GGUF file or gemma3-270m (default: the embedded model)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    results: dict[str, dict[str, float]] = {}
    for batch in args.batches:
        runners = {mode: prefilled(mode, batch, args.context, (args.rounds + 1) * args.steps, args.model)
                   for mode in args.modes}
        for mode, runner in runners.items():
            linears = runner.model.linears()
            kept = sorted(layer.format for layer in linears if isinstance(layer, QuantizedLinear))
            print(f"{mode}: {len(kept)} of {len(linears)} linears on quantized blocks "
                  f"({', '.join(f'{name} x{kept.count(name)}' for name in sorted(set(kept)))})", flush=True)
        step_index = dict.fromkeys(runners, 1)
        best = dict.fromkeys(runners, float("inf"))
        for round_index in range(args.rounds + 1):  # the first round warms up
            for mode in args.modes if round_index % 2 == 0 else args.modes[::-1]:
                started = clock()
                for _ in range(args.steps):
                    runners[mode].execute(StepPlan(step_index[mode], scheduled_handles=list(range(batch)),
                                                   num_scheduled_tokens=[1] * batch))
                    step_index[mode] += 1
                if round_index:
                    best[mode] = min(best[mode], (clock() - started) / args.steps * 1e3)
        results[str(batch)] = best
        print(f"batch {batch}, context {args.context}: " + ", ".join(f"{m} {ms:.1f} ms/step" for m, ms in best.items()),
              flush=True)
        del runners
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model or "embedded", "threads": args.threads, "context": args.context,
                       "ms_per_step": results}, f, indent=2)


if __name__ == "__main__":
    main()
