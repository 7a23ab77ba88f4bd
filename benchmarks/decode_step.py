"""Milliseconds per decode step of the model runner alone, optionally with a torch profile.

B requests each hold a CONTEXT-token prompt in the KV cache; every timed step decodes one
token for each. The per-change figures in benchmarks/README.md come from this script.

    .venv/bin/python -m benchmarks.decode_step --batch 64 --context 128 [--steps 10] [--profile]
    .venv/bin/python -m benchmarks.decode_step --batch 1 --attention-backend torch --no-small-batch-linear
    .venv/bin/python -m benchmarks.decode_step --batch 64 --dtype bfloat16 --profile   (or --weights native|int8)
"""

from __future__ import annotations

import argparse
import time

import torch

from vmesh.services.common.model_loading import embedded_model_file, load_model_spec, resolve_model_dir
from vmesh.services.common.step_types import NewRequest, StepPlan
from vmesh.services.common.types import SamplingParams
from vmesh.services.worker.kv_cache import bytes_per_block
from vmesh.services.worker.model_runner import ModelRunner, WorkerConfig

WARMUP_STEPS = 3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=128, help="cached prompt tokens per request")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--no-small-batch-linear", action="store_true")
    parser.add_argument("--profile", action="store_true", help="print a torch profile of 5 more steps")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--weights", default="dequantized", choices=("dequantized", "native", "int8"),
                        help="native reads the embedded GGUF file's blocks")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    decode_steps = WARMUP_STEPS + args.steps + (5 if args.profile else 0)
    model = str(embedded_model_file() if args.weights == "native" else resolve_model_dir(None))
    config = WorkerConfig(model=model, max_num_seqs=args.batch, dtype=args.dtype, weights=args.weights,
                          attention_backend=args.attention_backend, small_batch_linear=not args.no_small_batch_linear)
    block_size = config.block_size
    blocks_per_request = -(-(args.context + decode_steps) // block_size)
    spec = load_model_spec(resolve_model_dir(None))
    kv_dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    config.kv_cache_memory = args.batch * blocks_per_request * bytes_per_block(spec, block_size, kv_dtype)
    runner = ModelRunner.load(config)
    handles = list(range(args.batch))
    params = SamplingParams(temperature=0, max_tokens=decode_steps + 1, ignore_eos=True)
    plan = StepPlan(step=0, scheduled_handles=list(handles), num_scheduled_tokens=[args.context] * args.batch)
    for i in handles:
        prompt = [(7 * i + j) % 1000 + 1 for j in range(args.context)]
        blocks = list(range(i * blocks_per_request, (i + 1) * blocks_per_request))
        plan.new_requests.append(NewRequest(i, prompt, args.context, params, blocks))
    runner.execute(plan)
    step = 1

    def decode() -> None:
        nonlocal step
        runner.execute(StepPlan(step, scheduled_handles=list(handles), num_scheduled_tokens=[1] * args.batch))
        step += 1

    for _ in range(WARMUP_STEPS):
        decode()
    started = time.perf_counter()
    for _ in range(args.steps):
        decode()
    elapsed = time.perf_counter() - started
    print(f"{args.dtype} {args.weights}, batch {args.batch}, context {args.context}, attention {runner.backend.name}: "
          f"{elapsed / args.steps * 1e3:.1f} ms/step, {args.batch * args.steps / elapsed:.1f} tokens/s")
    if args.profile:
        from torch.profiler import profile

        with profile() as prof:
            for _ in range(5):
                decode()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
