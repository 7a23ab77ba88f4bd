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
import contextlib
import json
import statistics
from pathlib import Path

import torch

from vmesh.services.bench.common import load_workload
from vmesh.services.bench.offline import engine_in_own_process
from vmesh.services.common.model_loading import gguf_model_file, resolve_model_dir
from vmesh.services.speculative.config import SpeculativeConfig

KV_CACHE_MEMORY = 512 << 20


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
    torch.set_num_threads(min(2, torch.get_num_threads()))
    largest = max(args.batches)
    # No batch-size limit: this is the measurement the limit is set from.
    arms = {"plain": None, "spec": SpeculativeConfig("ngram", args.k, disable_by_batch_size=0)}
    # --weights native reads the GGUF file's own blocks; the other modes the converted directory.
    model = gguf_model_file(None) if args.weights == "native" else resolve_model_dir(None)
    assert model is not None
    result: dict[str, dict[int, dict[str, float]]] = {}
    for workload in args.workloads:
        prompts = load_workload(workload, largest, None)["prompts"]
        with contextlib.ExitStack() as stack:
            # Each engine in a process of its own: two in one process share it with two OpenMP
            # pools, which slows both (services/bench/offline.py, engine_in_own_process).
            runs = {name: stack.enter_context(engine_in_own_process(
                model, prompts, args.max_tokens, KV_CACHE_MEMORY, args.dtype, args.weights,
                speculative=speculative, max_num_seqs=largest)).run for name, speculative in arms.items()}
            for run in runs.values():
                run(2)  # first-call costs out of the figures
            result[workload] = {}
            for batch in args.batches:
                times: dict[str, list[float]] = {name: [] for name in runs}
                for _ in range(args.rounds):
                    for name, run in runs.items():
                        times[name].append(run(batch))
                figures = {name: statistics.median(values) for name, values in times.items()}
                figures["ratio"] = figures["spec"] / figures["plain"]
                result[workload][batch] = figures
                print(f"{workload} batch {batch:>3}: plain {figures['plain']:7.1f} tok/s, with speculation "
                      f"{figures['spec']:7.1f} tok/s, ratio {figures['ratio']:.2f}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"weights": args.weights, "dtype": args.dtype, "k": args.k,
                                        "max_tokens": args.max_tokens,
                                        "threads": torch.get_num_threads(), "result": result}, indent=1))


if __name__ == "__main__":
    main()
