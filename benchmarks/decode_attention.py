"""Decode attention on CPU, per layer: the C kernel (vmesh/kernels/cpu/paged_attention.h) over a batch of
decodes, each with its own context (block tables shuffled, as a long-running pool's are), on the
default model's heads (9 query, 3 KV, head_dim 64), over an 8-bit, a bfloat16 and a float32 cache.
Thirty layers' caches, so that they come from memory as in a real step; `--shared`: every request
reads the same blocks, which then sit in L2, so the figure is the kernel's arithmetic alone. Prints
milliseconds per layer (best of --repeats) and the cache bytes read per second.

    .venv/bin/python -m benchmarks.decode_attention [--batch 64] [--context 320] [--shared]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from tests.support.paged import ragged_batch
from vmesh.kernels.cpu_native import CpuKernels, load_cpu_kernels
from vmesh.kernels.reference import quantize_kv_int8_ref
from vmesh.services.common.model_loading import default_cache_dir

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30


def run_layers(kernels: CpuKernels, layers: list[tuple]) -> None:
    for q, kc, vc, items, out in layers:
        kernels.paged_attention(q, kc, vc, items, HEAD_DIM ** -0.5, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=320)
    parser.add_argument("--shared", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    kernels = load_cpu_kernels(Path(default_cache_dir()))
    rows = torch.arange(args.batch)
    for dtype in (torch.int8, torch.bfloat16, torch.float32):
        layers = []
        for layer in range(LAYERS):
            q, kc, vc, _, seq_lens, tables = ragged_batch([1] * args.batch, [args.context - 1] * args.batch, HEADS,
                                                          KV_HEADS, HEAD_DIM, args.block_size,
                                                          torch.float32 if dtype == torch.int8 else dtype, seed=layer)
            if dtype == torch.int8:  # the 8-bit cache's rows (vmesh/kernels/cpu/kv_int8.h)
                kc, vc = quantize_kv_int8_ref(kc), quantize_kv_int8_ref(vc)
            if args.shared:
                tables = tables[:1].expand(args.batch, -1).contiguous()
            items = kernels.attention_items(tables, rows, rows, seq_lens)
            layers.append((q.float().contiguous(), kc, vc, items, torch.empty(args.batch, HEADS, HEAD_DIM)))

        run_layers(kernels, layers)
        best = float("inf")
        for _ in range(args.repeats):
            started = time.perf_counter()
            run_layers(kernels, layers)
            best = min(best, (time.perf_counter() - started) / LAYERS)
        cache_bytes = args.batch * args.context * 2 * KV_HEADS * kc.shape[-1] * kc.element_size()
        print(f"{str(dtype).removeprefix('torch.'):>9}: {best * 1e3:.3f} ms per layer, "
              f"{cache_bytes / best / 1e9:.1f} GB/s of cache")


if __name__ == "__main__":
    main()
