"""oneDNN's packed linears by row count: does one packing (the rows hint Linear uses) serve every
batch, and how near the machine's peak do they run?

    .venv/bin/python -m benchmarks.linear_packing [--dtype bfloat16] [--rows 1 8 64 256 1024]
        [--hints 1 64 512 2048] [--threads 2] [--repeats 200]

For each of the default model's linear shapes (its config: hidden, q/kv heads, intermediate,
vocabulary) and each row count, times `mkldnn._linear_pointwise` over weights packed with each
rows hint, and plain `F.linear` over the unpacked weight, interleaved (the machine drifts), best
of --rounds medians. Prints GFLOP/s (a multiply-add counts two) and, per row count, the packing
hint that won, against the hint in use (services/worker/linear.py: PACKING_ROWS_HINT).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from vmesh.services.common.model_loading import load_model_spec, resolve_model_dir
from vmesh.services.worker.linear import PACKING_ROWS_HINT


def model_shapes() -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each linear in the default model's layers, and its LM head."""
    spec = load_model_spec(resolve_model_dir(None))
    hidden, q, kv = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    return {
        "qkv": (q + 2 * kv, hidden),
        "o": (hidden, q),
        "gate_up": (2 * spec.intermediate_size, hidden),
        "down": (hidden, spec.intermediate_size),
        "lm_head": (spec.vocab_size, hidden),
    }


def time_call(fn, repeats: int) -> float:
    """Median seconds of one call, over `repeats` calls after a warm-up."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--hints", type=int, nargs="+", default=[1, 64, 512, 2048])
    parser.add_argument("--shapes", nargs="+", default=None, help="of qkv o gate_up down lm_head (default: all)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    shapes = model_shapes()
    results = []
    for name in args.shapes or list(shapes):
        out_features, in_features = shapes[name]
        weight = torch.randn(out_features, in_features).to(dtype) * 0.02
        packed = {hint: torch.ops.mkldnn._reorder_linear_weight(weight, hint) for hint in args.hints}
        for rows in args.rows:
            x = torch.randn(rows, in_features).to(dtype)
            variants = {f"hint {hint}": (lambda p=p, x=x: torch.ops.mkldnn._linear_pointwise(
                x, p, None, "none", [], "")) for hint, p in packed.items()}
            variants["F.linear"] = lambda x=x, w=weight: F.linear(x, w)
            best = {label: float("inf") for label in variants}
            for _ in range(args.rounds):
                for label, fn in variants.items():
                    best[label] = min(best[label], time_call(fn, args.repeats))
            flops = 2.0 * rows * in_features * out_features
            rates = {label: flops / seconds / 1e9 for label, seconds in best.items()}
            winner = max(rates, key=rates.__getitem__)
            in_use = rates[f"hint {PACKING_ROWS_HINT}"] if PACKING_ROWS_HINT in args.hints else float("nan")
            print(f"{name:8s} {out_features:6d}x{in_features:<5d} rows {rows:5d}: "
                  + "  ".join(f"{label} {rate:7.1f}" for label, rate in rates.items())
                  + f"  GFLOP/s; best {winner} ({rates[winner] / in_use:.2f}x hint {PACKING_ROWS_HINT})", flush=True)
            results.append({"shape": name, "out": out_features, "in": in_features, "rows": rows,
                            "gflops": rates, "seconds": best})
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"dtype": args.dtype, "threads": args.threads, "results": results}, handle, indent=1)


if __name__ == "__main__":
    main()
