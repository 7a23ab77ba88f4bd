"""`--weights int8`'s batch products as a decode step meets them: the embedded model's 30 layers
(qkv, o, gate_up, down) with weights of their own, which come from memory, against the same calls
all on layer 0's weights, which stay in cache; bfloat16 in and out, as `--weights int8 --dtype
bfloat16` runs them. Alternating in one process, so that the machine's drift reaches both alike;
prints each one's median milliseconds per step and their ratio. The gap is what fetching weights
costs the kernel (vmesh/kernels/cpu/int8_linear.c: each thread fetches its next tile ahead).

    .venv/bin/python -m benchmarks.int8_layers_from_memory [--rows 64] [--rounds 15] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vmesh.kernels.cpu_native import load_cpu_kernels
from vmesh.services.common.model_loading import default_cache_dir
from vmesh.services.worker.int8_linear import pack_for_blocks, quantize_per_row

LAYERS = 30
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}  # (out, in)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if min(args.rows, args.rounds, args.threads) < 1:
        parser.error("--rows, --rounds and --threads are at least 1")
    torch.set_num_threads(args.threads)
    kernels = load_cpu_kernels(default_cache_dir())
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layer = []
        for out, width in SHAPES.values():
            codes, scale = quantize_per_row(torch.randn(out, width))
            layer.append((pack_for_blocks(codes), scale))
        layers.append(layer)
    inputs = {width: torch.randn(args.rows, width).bfloat16() for _, width in SHAPES.values()}

    def step(own_weights: bool) -> float:
        started = time.perf_counter()
        for index in range(LAYERS):
            for packed, scale in layers[index if own_weights else 0]:
                kernels.int8_block_linear(inputs[packed.shape[1] * 4], packed, scale, None, torch.bfloat16)
        return time.perf_counter() - started

    step(True), step(False)
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.rounds):
        for own_weights in (True, False):
            times[own_weights].append(step(own_weights))
    from_memory, cached = (statistics.median(times[key]) * 1e3 for key in (True, False))
    print(f"{args.rows} rows, {LAYERS} layers x 4 products, {torch.get_num_threads()} threads: weights from memory "
          f"{from_memory:.2f} ms per step, cached {cached:.2f} ms; from memory / cached {from_memory / cached:.3f}")


if __name__ == "__main__":
    main()
