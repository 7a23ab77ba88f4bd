"""Tensor parallelism's cost: the mesh with one worker against a tensor-parallel group.

    python -m benchmarks.tensor_parallel [--sizes 1,3] [--model FILE] [--device cpu|cuda]

For each group size the mesh serves, in turn, one request alone (its mean inter-token latency is
the decode step time at batch 1) and a batch of requests (output tokens per second, and the mean
step time rank 0's stats report). Beside them, the bytes each rank all-reduces per decode step,
from the model's shape: an all-reduce of the hidden state after o_proj and after down_proj in
every layer and after the vocabulary-parallel embedding lookup, and an all-gather of the logits.

On this 2-core CPU machine a group only splits the same two cores between more processes, so the
figures show the overhead, not a speed-up. `--device cuda` runs the same comparison on a machine
with one GPU per rank (NCCL refuses two ranks on one GPU).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics

from vmesh.services.bench.common import load_workload, mesh_generate, timed_request
from vmesh.services.bench.mesh import start_mesh
from vmesh.services.client import VmeshClient
from vmesh.services.common.model_loading import load_model_spec, resolve_model_dir


def all_reduce_bytes_per_token(model: str | None) -> dict[str, int]:
    spec = load_model_spec(resolve_model_dir(model))
    element = 4  # float32 activations
    hidden = spec.hidden_size * element
    return {"all_reduce": (2 * spec.num_layers + 1) * hidden, "logits_all_gather": spec.vocab_size * element}


async def single(address: str, prompt: list[int], max_tokens: int) -> float:
    async with VmeshClient(address) as client:
        await client.complete(token_ids=prompt, max_tokens=2, temperature=0)  # warm-up
        run = await timed_request(client, prompt, max_tokens)
    return statistics.fmean(run["itl"]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,3", help="group sizes (the embedded model's 9 query and 3 KV heads "
                                                       "divide by 1 and 3)")
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--out", default="benchmarks/results/tensor_parallel.json")
    args = parser.parse_args()
    work = load_workload("standard", args.requests, args.max_tokens)
    device = ["--device", args.device] + (["--attention-backend", "triton"] if args.device == "cuda" else [])
    model = ["--model", args.model] if args.model else []
    per_token = all_reduce_bytes_per_token(args.model)
    results = {}
    for size in (int(s) for s in args.sizes.split(",")):
        mesh = start_mesh("--tensor-parallel-size", str(size), "--kv-cache-memory", "256MiB", *device, *model)
        try:
            itl_ms = asyncio.run(single(mesh.address, work["latency_prompt"], args.max_tokens))
            batch = asyncio.run(mesh_generate(mesh, work["prompts"], work["max_tokens"]))
        finally:
            mesh.stop()
        exchanged = 0 if size == 1 else per_token["all_reduce"] + per_token["logits_all_gather"]
        results[size] = {"single_request_itl_ms": itl_ms, "batch_tokens_per_s": batch["tokens_per_s"],
                         "collective_bytes_per_request_per_decode_step": exchanged}
        print(f"TP={size}: single request {itl_ms:.1f} ms per token; {args.requests} requests "
              f"{batch['tokens_per_s']:.1f} tokens/s; each rank all-reduces {per_token['all_reduce'] / 1024:.1f} KiB "
              f"and gathers {per_token['logits_all_gather'] / 1024:.1f} KiB of logits per request per decode step"
              if size > 1 else f"TP=1: single request {itl_ms:.1f} ms per token; {args.requests} requests "
              f"{batch['tokens_per_s']:.1f} tokens/s", flush=True)
    with open(args.out, "w") as f:
        json.dump({"command": "python -m benchmarks.tensor_parallel " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k != "out"),
                   "bytes_per_token": per_token, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
