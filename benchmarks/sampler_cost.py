"""Milliseconds per Sampler call over the embedded model's vocabulary (49,152 logits a row), by
batch size and sampling mode: greedy, temperature, temperature with top-p, temperature with top-k.
The logits are random normals scaled like a small model's (standard deviation 3).

--baseline-ref REF: the same over a temporary worktree of REF, each tree in its own process,
alternating in --rounds rounds; prints each round and the medians.

    .venv/bin/python -m benchmarks.sampler_cost [--batches 1 64] [--threads 2]
    .venv/bin/python -m benchmarks.sampler_cost --baseline-ref HEAD~1 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

VOCAB = 49152
MODES = {"greedy": {"temperature": 0.0}, "temperature 0.8": {"temperature": 0.8},
         "top-p 0.9": {"temperature": 0.8, "top_p": 0.9}, "top-k 50": {"temperature": 0.8, "top_k": 50}}


def measure(batches: list[int], threads: int, calls: int) -> dict[str, float]:
    import torch

    from vmesh.services.worker.sampler import NO_LOGPROBS, Sampler, SamplingBatch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    sampler = Sampler()
    figures = {}
    for rows in batches:
        logits = torch.randn(rows, VOCAB) * 3.0
        for mode, settings in MODES.items():
            batch = SamplingBatch(
                temperature=torch.full((rows,), settings["temperature"]),
                top_k=torch.full((rows,), settings.get("top_k", -1), dtype=torch.int64),
                top_p=torch.full((rows,), settings.get("top_p", 1.0)), min_p=torch.zeros(rows),
                repetition_penalty=torch.ones(rows), presence_penalty=torch.zeros(rows),
                frequency_penalty=torch.zeros(rows), num_logprobs=torch.full((rows,), NO_LOGPROBS),
                generators=[None] * rows, seeds=[None] * rows, positions=[0] * rows)
            sampler(logits, batch)  # warm-up
            started = time.perf_counter()
            for _ in range(calls):
                sampler(logits, batch)
            figures[f"{rows} rows, {mode}"] = (time.perf_counter() - started) / calls * 1e3
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--baseline-ref", help="also time a worktree of this git ref, alternating rounds")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # a --baseline-ref child's output
    args = parser.parse_args()
    if args.json:
        print(json.dumps(measure(args.batches, args.threads, args.calls)))
        return
    if not args.baseline_ref:
        for name, ms in measure(args.batches, args.threads, args.calls).items():
            print(f"{name:>24}: {ms:8.2f} ms")
        return
    from benchmarks.baseline_tree import baseline_trees

    script = Path(__file__).resolve()
    child = [sys.executable, str(script), "--json", "--threads", str(args.threads), "--calls", str(args.calls),
             "--batches", *map(str, args.batches)]
    rounds: dict[str, list[dict[str, float]]] = {}
    with baseline_trees(args.baseline_ref) as by_name:
        for i in range(args.rounds):
            names = list(by_name) if i % 2 == 0 else list(reversed(by_name))
            for name in names:
                # Every tree runs this script, importing that tree's vmesh.
                out = subprocess.run(child, cwd=by_name[name], env={**os.environ, "PYTHONPATH": str(by_name[name])},
                                     capture_output=True, text=True, check=True)
                rounds.setdefault(name, []).append(json.loads(out.stdout))
                print(f"round {i + 1} {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in rounds[name][-1].items()))
    print(f"medians, ms per call: {args.baseline_ref} / this")
    for key in rounds["this"][0]:
        before = statistics.median(r[key] for r in rounds[args.baseline_ref])
        after = statistics.median(r[key] for r in rounds["this"])
        print(f"{key:>24}: {before:8.2f} / {after:8.2f} ({after / before:.3f})")


if __name__ == "__main__":
    main()
