"""bfloat16 against float32 on the CPU: greedy agreement on the standard workload,
perplexity on a fixed text, and engine throughput, interleaved A/B.

    .venv/bin/python -m benchmarks.bf16                      # 64 requests x 128 tokens, 2 rounds
    .venv/bin/python -m benchmarks.bf16 --max-tokens 32 --rounds 2 --threads 2

(a) Both engines (float32 and bfloat16, the embedded model) load once and run the workload's
prompts greedily, EOS ignored, in alternating order each round (A B, then B A: the machine
drifts); the first round's outputs give the agreement: the fraction of requests whose whole
output is identical, and the mean fraction of each output's tokens that match before the first
difference. (c) Every round's wall time gives tokens/s per dtype; medians are reported. (d) In the same
rounds, the workload's latency prompt alone (one stream: 1-row linears) for --single-tokens tokens.
(b) Perplexity of each dtype's model over benchmarks/data/bf16_perplexity.txt (the embedded
model's tokenizer, no BOS), teacher-forced in chunks of CHUNK tokens through the paged KV cache.

    .venv/bin/python -m benchmarks.bf16 --decode-steps --batches 1 4 64 --context 128

instead times the model runner alone: ms per decode step at each batch size, every request
holding --context cached tokens, the two dtypes alternating over --rounds rounds (minimum kept).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from vmesh.services.bench.common import load_workload
from vmesh.services.common.model_loading import load_model_spec, load_tokenizer, resolve_model_dir
from vmesh.services.common.step_types import NewRequest, StepPlan
from vmesh.services.common.types import SamplingParams
from vmesh.services.worker.attention import AttentionMetadata
from vmesh.services.worker.kv_cache import bytes_per_block
from vmesh.services.worker.model_runner import ModelRunner, WorkerConfig

TEXT = Path(__file__).parent / "data" / "bf16_perplexity.txt"
CHUNK = 256  # tokens per forward pass in the perplexity run
DTYPES = ("float32", "bfloat16")


def perplexity(runner: ModelRunner, token_ids: list[int]) -> float:
    """exp(mean NLL) of each token given all before it: one request, prefilled chunk by chunk,
    with logits at every position (float32 log-softmax whatever the model's dtype)."""
    model, kv_cache = runner.model, runner.kv_cache
    block_size = kv_cache.block_size
    blocks = -(-len(token_ids) // block_size)
    if blocks > kv_cache.num_blocks:
        raise SystemExit(f"the text needs {blocks} KV blocks, the cache holds {kv_cache.num_blocks}")
    table = torch.arange(blocks, dtype=torch.int32)[None, :]
    ids = torch.tensor(token_ids)
    nll = 0.0
    for start in range(0, len(token_ids) - 1, CHUNK):
        end = min(start + CHUNK, len(token_ids) - 1)  # the last token is only ever a target
        n = end - start
        meta = AttentionMetadata(slot_mapping=torch.arange(start, end), query_start_loc=torch.tensor([0, n],
                                 dtype=torch.int32), seq_lens=torch.tensor([end], dtype=torch.int32),
                                 block_tables=table, query_lens_cpu=[n], seq_lens_cpu=[end])
        logits = model.forward(ids[start:end], torch.arange(start, end), meta, kv_cache, runner.backend,
                               torch.arange(n))
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        nll -= float(log_probs.gather(1, ids[start + 1:end + 1, None]).sum())
    return math.exp(nll / (len(token_ids) - 1))


def decode_steps(model_dir: Path, batches: list[int], context: int, rounds: int, steps: int = 10,
                 small_batch_linear: bool = True) -> dict[str, Any]:
    """ms per decode step of the model runner alone, per batch size and dtype (minimum over rounds)."""
    results: dict[str, Any] = {}
    for batch in batches:
        blocks_per_request = -(-(context + 3 + rounds * steps + 1) // 16)
        block_bytes = bytes_per_block(load_model_spec(model_dir), 16, torch.float32)  # enough for either dtype
        runners, steps_done = {}, {}
        for dtype in DTYPES:
            runner = ModelRunner.load(WorkerConfig(model=str(model_dir), dtype=dtype, max_num_seqs=batch, block_size=16,
                                                   kv_cache_memory=batch * blocks_per_request * block_bytes,
                                                   small_batch_linear=small_batch_linear))
            params = SamplingParams(temperature=0, max_tokens=context + rounds * steps + 8, ignore_eos=True)
            plan = StepPlan(step=0, scheduled_handles=list(range(batch)), num_scheduled_tokens=[context] * batch)
            for i in range(batch):
                prompt = [(7 * i + j) % 1000 + 1 for j in range(context)]
                plan.new_requests.append(NewRequest(i, prompt, context, params,
                                                    list(range(i * blocks_per_request, (i + 1) * blocks_per_request))))
            runner.execute(plan)
            for step in range(1, 4):  # warm-up
                runner.execute(StepPlan(step, scheduled_handles=list(range(batch)), num_scheduled_tokens=[1] * batch))
            runners[dtype], steps_done[dtype] = runner, 4
        times: dict[str, list[float]] = {dtype: [] for dtype in DTYPES}
        for round_index in range(rounds):
            for dtype in DTYPES if round_index % 2 == 0 else DTYPES[::-1]:
                runner = runners[dtype]
                started = time.perf_counter()
                for _ in range(steps):
                    runner.execute(StepPlan(steps_done[dtype], scheduled_handles=list(range(batch)),
                                            num_scheduled_tokens=[1] * batch))
                    steps_done[dtype] += 1
                times[dtype].append((time.perf_counter() - started) / steps * 1e3)
        results[str(batch)] = {f"{dtype}_ms": min(runs) for dtype, runs in times.items()}
        results[str(batch)]["bf16_speedup"] = min(times["float32"]) / min(times["bfloat16"])
        print(f"batch {batch}, context {context}: " + ", ".join(f"{dtype} {min(runs):.1f} ms/step"
                                                                  for dtype, runs in times.items()), flush=True)
        del runners
    return results


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict[str, float]:
    identical = sum(a == b for a, b in zip(reference, other))
    leading = []
    for a, b in zip(reference, other):
        first_difference = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        leading.append(first_difference / len(a))
    return {"identical_requests": identical / len(reference), "mean_leading_match": statistics.fmean(leading)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=None, help="default: all of the workload's (64)")
    parser.add_argument("--max-tokens", type=int, default=None, help="default: the workload's (128)")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds per dtype, interleaved")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--text", type=Path, default=TEXT)
    parser.add_argument("--single-tokens", type=int, default=64, help="tokens of the single-stream run (0: none)")
    parser.add_argument("--skip-perplexity", action="store_true")
    parser.add_argument("--decode-steps", action="store_true", help="time decode steps of the runner alone")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 64])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--no-small-batch-linear", action="store_true", help="decode steps: no C linear kernels")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here too")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(None)
    result: dict[str, Any] = {"threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d %H:%M")}
    if args.decode_steps:
        result["decode_steps"] = decode_steps(model_dir, args.batches, args.context, args.rounds,
                                              small_batch_linear=not args.no_small_batch_linear)
        print(json.dumps(result, indent=2))
        if args.out:
            args.out.write_text(json.dumps(result, indent=2) + "\n")
        return

    if not args.skip_perplexity:
        token_ids = load_tokenizer(model_dir)(args.text.read_text())["input_ids"]
        result["perplexity_tokens"] = len(token_ids)
        result["perplexity"] = {}
        for dtype in DTYPES:
            runner = ModelRunner.load(WorkerConfig(model=str(model_dir), dtype=dtype, kv_cache_memory=256 << 20))
            started = time.perf_counter()
            result["perplexity"][dtype] = perplexity(runner, token_ids)
            print(f"perplexity {dtype}: {result['perplexity'][dtype]:.4f} ({len(token_ids)} tokens, "
                  f"{time.perf_counter() - started:.1f} s)", flush=True)
            del runner

    from vmesh.services.engine.llm import EngineConfig, LLMEngine

    work = load_workload("standard", args.requests, args.max_tokens)
    prompts, max_tokens = work["prompts"], work["max_tokens"]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engines = {dtype: LLMEngine.from_config(EngineConfig(worker=WorkerConfig(model=str(model_dir), dtype=dtype,
                                                                             max_num_seqs=256)))
               for dtype in DTYPES}
    outputs: dict[str, list[list[int]]] = {}
    speeds: dict[str, list[float]] = {dtype: [] for dtype in DTYPES}
    single: dict[str, list[float]] = {dtype: [] for dtype in DTYPES}
    single_params = SamplingParams(temperature=0, max_tokens=args.single_tokens, ignore_eos=True)
    try:
        for engine in engines.values():
            engine.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2))  # warm-up
        for round_index in range(args.rounds):
            for dtype in DTYPES if round_index % 2 == 0 else DTYPES[::-1]:
                engine = engines[dtype]
                engine.reset_prefix_cache()  # every round starts cold
                started = time.perf_counter()
                outs = engine.generate(prompts, params)
                elapsed = time.perf_counter() - started
                assert all(len(o.token_ids) == max_tokens for o in outs)
                outputs.setdefault(dtype, [o.token_ids for o in outs])
                speeds[dtype].append(len(prompts) * max_tokens / elapsed)
                print(f"round {round_index + 1} {dtype}: {speeds[dtype][-1]:.1f} tokens/s", flush=True)
                if args.single_tokens:
                    engine.reset_prefix_cache()
                    started = time.perf_counter()
                    engine.generate([work["latency_prompt"]], single_params)
                    single[dtype].append(args.single_tokens / (time.perf_counter() - started))
                    print(f"round {round_index + 1} {dtype} single stream: {single[dtype][-1]:.1f} tokens/s",
                          flush=True)
    finally:
        for engine in engines.values():
            engine.shutdown()
    result["requests"], result["max_tokens"] = len(prompts), max_tokens
    result["agreement"] = agreement(outputs["float32"], outputs["bfloat16"])
    result["tokens_per_s"] = {dtype: statistics.median(runs) for dtype, runs in speeds.items()}
    result["runs_tokens_per_s"] = speeds
    result["bf16_over_f32"] = result["tokens_per_s"]["bfloat16"] / result["tokens_per_s"]["float32"]
    if args.single_tokens:
        result["single_stream_tokens_per_s"] = {dtype: statistics.median(runs) for dtype, runs in single.items()}
        result["runs_single_stream_tokens_per_s"] = single
        result["single_stream_bf16_over_f32"] = (result["single_stream_tokens_per_s"]["bfloat16"]
                                                 / result["single_stream_tokens_per_s"]["float32"])
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
