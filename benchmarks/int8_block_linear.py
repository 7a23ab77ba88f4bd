# ruff: noqa: B023  (each lambda is timed inside the iteration that defines it)
"""`--weights int8`'s two activation paths per call, on the embedded model's linear shapes:
16-bit activations per token against 8-bit per block of 64 (vmesh/kernels/cpu/int8_linear.c),
both bfloat16 in and out as in `--weights int8 --dtype bfloat16`, beside the bfloat16 mode's
linear (oneDNN's packed bfloat16, or the C kernel for 7-32 rows) and float32's. Prints
milliseconds per call (best of --repeats, all shapes summed) and each path's ratio to bfloat16;
the crossover row count is where the block path overtakes the 16-bit one.

    .venv/bin/python -m benchmarks.int8_block_linear [--rows 1 4 8 16 64 256 2000] [--repeats 5]
"""

from __future__ import annotations

import argparse
from unittest import mock

import torch

from benchmarks.prefill_attention import best_ms
from vmesh.kernels.cpu_native import load_cpu_kernels
from vmesh.services.common.model_loading import default_cache_dir
from vmesh.services.worker import int8_linear
from vmesh.services.worker.int8_linear import Int8Linear
from vmesh.services.worker.linear import Linear

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}  # (out, in)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 64, 256, 2000])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    kernels = load_cpu_kernels(default_cache_dir())
    torch.manual_seed(0)
    layers = {}
    for name, (out, width) in SHAPES.items():
        weight = torch.randn(out, width) * 0.05
        # The int8 layer as the mixed bfloat16 model builds it: bfloat16 in and out.
        layers[name] = (Int8Linear(weight.bfloat16(), None, kernels),
                        Linear(weight.bfloat16(), small_batch_kernels=kernels),
                        Linear(weight, small_batch_kernels=kernels))
    print(f"threads {torch.get_num_threads()}; ms per call, the four shapes summed")
    print(f"{'rows':>5} {'int8 16-bit':>12} {'int8 block':>11} {'bfloat16':>9} {'float32':>8} "
          f"{'block/16-bit':>13} {'bf16/block':>11}")
    for rows in args.rows:
        totals = {"16-bit": 0.0, "block": 0.0, "bf16": 0.0, "f32": 0.0}
        for name, (int8_layer, bf16_layer, f32_layer) in layers.items():
            x = torch.randn(rows, SHAPES[name][1])
            xb = x.bfloat16()
            with mock.patch.object(int8_linear, "BLOCK_PATH_MIN_ROWS", 1 << 30):
                totals["16-bit"] += best_ms(lambda: int8_layer(xb), args.repeats)
            with mock.patch.object(int8_linear, "BLOCK_PATH_MIN_ROWS", 1):
                totals["block"] += best_ms(lambda: int8_layer(xb), args.repeats)
            totals["bf16"] += best_ms(lambda: bf16_layer(xb), args.repeats)
            totals["f32"] += best_ms(lambda: f32_layer(x), args.repeats)
        print(f"{rows:>5} {totals['16-bit']:>12.3f} {totals['block']:>11.3f} {totals['bf16']:>9.3f} "
              f"{totals['f32']:>8.3f} {totals['16-bit'] / totals['block']:>13.2f} "
              f"{totals['bf16'] / totals['block']:>11.2f}")


if __name__ == "__main__":
    main()
