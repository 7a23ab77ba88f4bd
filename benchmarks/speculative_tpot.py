"""Single-request time per output token with and without n-gram speculation, in process.

The overlap workload's latency prompt (`services/bench/overlap-64x128.json`: the embedded model
asked to repeat a passage; 128 greedy tokens, EOS ignored) through the in-process engine, once
without speculation and once per k of `--k`, in each of `--rounds` rounds (so that every variant
sees the same machine state), for each `--weights` mode. TPOT is the time after the first token
over the tokens after it, median over rounds; `x plain` is its ratio to the same round's run
without speculation. With `--threads 1` (the default) the clock is the process's CPU time, immune
to a shared machine's descheduling; else wall time.

    .venv/bin/python -m benchmarks.speculative_tpot [--weights dequantized native] [--k 3 4 6] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from vmesh.services.common.types import SamplingParams
from vmesh.services.engine.llm import EngineConfig, LLMEngine
from vmesh.services.speculative.config import SpeculativeConfig
from vmesh.services.worker.model_runner import WorkerConfig

WORKLOAD = Path(__file__).resolve().parents[1] / "services" / "bench" / "overlap-64x128.json"


def timed_request(engine: LLMEngine, prompt: list[int], max_tokens: int,
                  clock: Callable[[], float]) -> tuple[float, int]:
    """(seconds per token after the first, engine steps after the first token) for one greedy request."""
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    first_token_at = None
    tokens = steps = 0
    while engine.has_unfinished():
        outputs = engine.step()
        new = sum(len(out.new_token_ids) for out in outputs)
        if new and first_token_at is None:
            first_token_at, tokens = clock(), new
        elif new:
            tokens += new
            steps += 1
    assert first_token_at is not None and tokens == max_tokens, "the request ended early"
    return (clock() - first_token_at) / (tokens - 1), steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", nargs="+", default=["dequantized", "native"])
    parser.add_argument("--k", type=int, nargs="+", default=[3, 4, 6], help="num_speculative_tokens to compare")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.threads == 1 else time.perf_counter
    workload = json.loads(WORKLOAD.read_text())
    prompt, max_tokens = workload["latency_prompt_token_ids"], workload["max_new_tokens"]
    variants: dict[str, SpeculativeConfig | None] = {"plain": None}
    variants.update({f"k={k}": SpeculativeConfig("ngram", k) for k in args.k})
    results = []
    for weights in args.weights:
        engines = {name: LLMEngine.from_config(EngineConfig(worker=WorkerConfig(
            weights=weights, kv_cache_memory=64 << 20, max_num_seqs=4, speculative_config=speculative)))
            for name, speculative in variants.items()}
        for engine in engines.values():
            timed_request(engine, prompt, 8, clock)  # warm-up: kernels built, buffers sized
        tpot: dict[str, list[float]] = {name: [] for name in engines}
        ratio: dict[str, list[float]] = {name: [] for name in engines}
        steps: dict[str, int] = {}
        for _ in range(args.rounds):
            for name, engine in engines.items():
                seconds, steps[name] = timed_request(engine, prompt, max_tokens, clock)
                tpot[name].append(seconds)
            for name in engines:
                ratio[name].append(tpot[name][-1] / tpot["plain"][-1])
        for engine in engines.values():
            engine.shutdown()
        for name in engines:
            row = {"weights": weights, "variant": name, "tpot_ms": statistics.median(tpot[name]) * 1e3,
                   "x_plain": statistics.median(ratio[name]), "steps": steps[name],
                   "tokens_per_step": (max_tokens - 1) / steps[name], "rounds_ms": [t * 1e3 for t in tpot[name]]}
            results.append(row)
            print(f"{weights:12s} {name:6s}: TPOT {row['tpot_ms']:6.2f} ms (x plain {row['x_plain']:.2f}), "
                  f"{row['steps']} decode steps, {row['tokens_per_step']:.2f} tokens per step; rounds "
                  + ", ".join(f"{t:.2f}" for t in row["rounds_ms"]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"threads": args.threads, "rounds": args.rounds, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
