"""Where n-gram speculation stops paying: output tokens per second of the in-process engine with
and without it, at each number of requests in flight, on the overlap workload (outputs that
repeat their prompts) and the standard one (they rarely do). The two engines share the machine
and run in turn, round by round.

    python -m benchmarks.spec_crossover [--batches 1 2 4 8 16 32] [--max-tokens 64]
        [--weights native|int8] [--dtype bfloat16]

The ratio (with / without) is what `disable_by_batch_size` should follow: speculation pays while
a step is bound by reading the weights (a few rows), and costs once it is bound by arithmetic
(verifying rejected drafts is work the batch would have done anyway).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from vmesh.services.bench.common import load_workload
from vmesh.services.common.types import SamplingParams
from vmesh.services.engine.llm import EngineConfig, LLMEngine
from vmesh.services.speculative.config import SpeculativeConfig
from vmesh.services.worker.config import WorkerConfig


def engine(weights: str, dtype: str, speculative: SpeculativeConfig | None, max_num_seqs: int) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig(worker=WorkerConfig(
        weights=weights, dtype=dtype, speculative_config=speculative, max_num_seqs=max_num_seqs,
        kv_cache_memory=512 << 20)))


def tokens_per_s(llm: LLMEngine, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--weights", default="dequantized", choices=("dequantized", "native", "int8"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--workloads", nargs="+", default=["overlap", "standard"])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    largest = max(args.batches)
    plain = engine(args.weights, args.dtype, None, largest)
    # No batch-size limit: this is the measurement the limit is set from.
    spec = engine(args.weights, args.dtype, SpeculativeConfig("ngram", args.k, disable_by_batch_size=0), largest)
    result: dict[str, dict[int, dict[str, float]]] = {}
    try:
        for workload in args.workloads:
            prompts = load_workload(workload, largest, None)["prompts"]
            tokens_per_s(plain, prompts[:2], 4)  # first-call costs out of the figures
            tokens_per_s(spec, prompts[:2], 4)
            result[workload] = {}
            for batch in args.batches:
                runs: dict[str, list[float]] = {"plain": [], "spec": []}
                for _ in range(args.rounds):
                    for name, llm in (("plain", plain), ("spec", spec)):
                        runs[name].append(tokens_per_s(llm, prompts[:batch], args.max_tokens))
                figures = {name: statistics.median(values) for name, values in runs.items()}
                figures["ratio"] = figures["spec"] / figures["plain"]
                result[workload][batch] = figures
                print(f"{workload} batch {batch:>3}: plain {figures['plain']:7.1f} tok/s, with speculation "
                      f"{figures['spec']:7.1f} tok/s, ratio {figures['ratio']:.2f}", flush=True)
    finally:
        plain.shutdown()
        spec.shutdown()
    if args.out:
        args.out.write_text(json.dumps({"weights": args.weights, "dtype": args.dtype, "k": args.k,
                                        "max_tokens": args.max_tokens,
                                        "threads": torch.get_num_threads(), "result": result}, indent=1))


if __name__ == "__main__":
    main()
