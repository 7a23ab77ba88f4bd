"""`--weights native` kernels: int8 dot products (vmesh/kernels/cpu/integer_linear.c) against the float32
block kernel (vmesh/kernels/cpu/quantized_linear.c) and oneDNN's packed float32 linear (`--weights
dequantized`), same run, on the embedded model's layer shapes (or with `--model gemma3`, Gemma 3
270M's) and random GGUF blocks of each format (a K-quant only on the shapes whose input width is a
multiple of its 256-value super-block); and `--weights int8` (vmesh/kernels/cpu/int8_linear.c) on the same
weights.

For each shape, format and row count, `--rounds` rounds alternate the three paths (so that each
sees the same machine state), each timing `--calls` calls; the median per call is reported as
GFLOP/s (2 x rows x out x in per call) and as the ratio integer / float32-blocks. With
`--threads 1` the clock is the thread's CPU time (see `main`), else wall time.

    .venv/bin/python -m benchmarks.integer_linear [--rows 1 4 16 64] [--formats Q4_0 Q4_1 Q8_0] [--threads 2]
        [--model smollm2|gemma3]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable

import torch

from tests.support.gguf_blocks import random_blocks
from vmesh.kernels.cpu_native import QUANTIZED_FORMATS, load_cpu_kernels
from vmesh.services.common.model_loading import cache_dir_path
from vmesh.services.worker.int8_linear import Int8Linear
from vmesh.services.worker.linear import Linear

FORMAT_IDS = {fmt.name: type_id for type_id, fmt in QUANTIZED_FORMATS.items()}
# Each model's linears, (name, out, in): the embedded SmolLM2-135M's and Gemma 3 270M's (whose GGUF
# stores o_proj as Q4_K, down_proj as Q4_K or Q6_K, the rest, 640 wide, as Q5_0 or Q8_0).
MODEL_SHAPES = {
    "smollm2": [("qkv_proj", 960, 576), ("o_proj", 576, 576), ("gate_up_proj", 3072, 576), ("down_proj", 576, 1536),
                ("lm_head", 49152, 576)],
    "gemma3": [("qkv_proj", 1536, 640), ("o_proj", 640, 1024), ("gate_up_proj", 4096, 640), ("down_proj", 640, 2048),
               ("lm_head", 262144, 640)],
}


def median_call(fn: Callable[[], object], rounds_out: list[float], calls: int, clock: Callable[[], float]) -> None:
    started = clock()
    for _ in range(calls):
        fn()
    rounds_out.append((clock() - started) / calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--formats", nargs="+", default=["Q4_0", "Q4_1", "Q8_0"], choices=sorted(FORMAT_IDS))
    parser.add_argument("--model", default="smollm2", choices=sorted(MODEL_SHAPES))
    parser.add_argument("--shapes", nargs="+", default=[name for name, _, _ in MODEL_SHAPES["smollm2"]])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # One thread runs every kernel on this thread: its CPU time is immune to a shared machine's
    # descheduling, which wall time on 2 loaded cores is not.
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    kernels = load_cpu_kernels(cache_dir_path(None))
    if not kernels.integer_dot:
        raise SystemExit("this CPU has no AVX-512 VNNI: there is no integer kernel to measure")
    results = []
    for name, out_features, in_features in (shape for shape in MODEL_SHAPES[args.model] if shape[0] in args.shapes):
        for fmt in args.formats:
            type_id = FORMAT_IDS[fmt]
            if in_features % QUANTIZED_FORMATS[type_id].block_values:
                continue
            blocks = torch.from_numpy(random_blocks(type_id, out_features, in_features))
            weight = kernels.quantized_rows(blocks, type_id, in_features, torch.arange(out_features))
            dense = Linear(weight, small_batch_kernels=kernels)
            int8 = Int8Linear(weight, None, kernels)  # `--weights int8` on the same values
            del weight
            for rows in args.rows:
                x = torch.randn(rows, in_features)
                product = functools.partial(kernels.quantized_linear, x, blocks, type_id, in_features, None)
                paths: dict[str, Callable[[], object]] = {
                    "integer": functools.partial(product, integer=True), "float_blocks": product,
                    "onednn_f32": functools.partial(dense, x), "int8_mode": functools.partial(int8, x)}
                times: dict[str, list[float]] = {path: [] for path in paths}
                for fn in paths.values():
                    fn()  # warm-up
                for _ in range(args.rounds):
                    for path, fn in paths.items():
                        median_call(fn, times[path], args.calls, clock)
                flops = 2 * rows * out_features * in_features
                seconds = {path: statistics.median(t) for path, t in times.items()}
                gflops = {path: flops / value / 1e9 for path, value in seconds.items()}
                ratio = gflops["integer"] / gflops["float_blocks"]
                results.append({"model": args.model, "layer": name, "format": fmt, "out": out_features,
                                "in": in_features, "rows": rows,
                                **{f"{path}_gflops": value for path, value in gflops.items()},
                                **{f"{path}_us": value * 1e6 for path, value in seconds.items()},
                                "integer_over_float_blocks": ratio,
                                "integer_over_onednn": gflops["integer"] / gflops["onednn_f32"],
                                "int8_mode_over_onednn": gflops["int8_mode"] / gflops["onednn_f32"]})
                print(f"{name:12s} {fmt} [{out_features:5d} x {in_features:4d}] rows {rows:3d}: GFLOP/s integer "
                      f"{gflops['integer']:6.1f}, float blocks {gflops['float_blocks']:6.1f}, oneDNN f32 "
                      f"{gflops['onednn_f32']:6.1f}, int8 mode {gflops['int8_mode']:6.1f}; integer / float blocks "
                      f"x{ratio:.2f}; us per call " + ", ".join(f"{value * 1e6:.0f}" for value in seconds.values()),
                      flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"threads": args.threads, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
