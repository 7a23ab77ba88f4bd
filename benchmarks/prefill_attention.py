# ruff: noqa: B023  (each lambda is timed inside the iteration that defines it)
"""Prefill attention on CPU, per layer: the tiled C kernel (vmesh/kernels/cpu/prefill_attention.c)
against the per-token C kernel it replaced for prefill chunks and the torch backend's SDPA
path, on the default model's heads (9 query, 3 KV, head_dim 64), run in turn in one process.
Prints milliseconds per layer (best of --repeats) and the tiled kernel's GFLOP/s. --cache-dtype
bfloat16: the bfloat16 mode's cache (the query and output stay float32); int8: the 8-bit cache
(`--kv-cache-dtype int8`, vmesh/kernels/cpu/kv_int8.h).

    .venv/bin/python -m benchmarks.prefill_attention [--repeats 5] [--cache-dtype bfloat16|int8]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tests.support.paged import ragged_batch
from vmesh.kernels.cpu_native import load_cpu_kernels
from vmesh.kernels.reference import quantize_kv_int8_ref
from vmesh.services.common.model_loading import default_cache_dir
from vmesh.services.worker.attention import AttentionMetadata, TorchAttentionBackend

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
CASES = [  # (label, query lengths, cached context before each chunk)
    ("one 2,000-token prompt", [2000], [0]),
    ("512 after 1,536 cached", [512], [1536]),
    ("four prompts' chunks: 512 after 0/512/1,024/1,536", [512] * 4, [0, 512, 1024, 1536]),
    ("8 chunks of 16 tokens", [16] * 8, [0] * 8),
    ("4 chunks of 64 after 64 cached", [64] * 4, [64] * 4),
]


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times) * 1e3


def causal_flops(query_lens: list[int], context_lens: list[int]) -> float:
    """Multiply-adds of QK^T and PV, two flops each, over the keys each query token sees."""
    keys_seen = sum(n * c + n * (n + 1) / 2 for n, c in zip(query_lens, context_lens))
    return 2 * 2 * keys_seen * HEADS * HEAD_DIM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cache-dtype", default="float32", choices=("float32", "bfloat16", "int8"))
    args = parser.parse_args()
    cache_dtype = getattr(torch, args.cache_dtype)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    kernels = load_cpu_kernels(Path(default_cache_dir()))
    sdpa = TorchAttentionBackend()
    print(f"{'case':<52} {'tiled':>8} {'per-token':>10} {'SDPA':>8}  tiled GFLOP/s")
    for label, query_lens, context_lens in CASES:
        q, kc, vc, starts, seq_lens, tables = ragged_batch(query_lens, context_lens, HEADS, KV_HEADS, HEAD_DIM,
                                                           BLOCK, torch.float32)
        if cache_dtype == torch.int8:
            kc, vc = quantize_kv_int8_ref(kc), quantize_kv_int8_ref(vc)
        else:
            kc, vc = kc.to(cache_dtype), vc.to(cache_dtype)
        if cache_dtype == torch.bfloat16:  # the bfloat16 mode's queries hold bfloat16 values
            q = q.bfloat16().float()
        rows = torch.arange(len(query_lens))
        lengths = torch.tensor(query_lens, dtype=torch.int32)
        chunks = kernels.prefill_chunks(tables, rows, starts[:-1].long(), lengths, seq_lens)
        token_rows = torch.arange(q.shape[0])
        request_rows = torch.repeat_interleave(rows, lengths.long())
        ends = starts[1:].long()
        context = (seq_lens.long()[request_rows] - (ends[request_rows] - 1 - token_rows)).int()
        items = kernels.attention_items(tables, request_rows, token_rows, context)
        meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long), query_start_loc=starts,
                                 seq_lens=seq_lens, block_tables=tables, query_lens_cpu=query_lens,
                                 seq_lens_cpu=seq_lens.tolist())
        out = torch.empty_like(q)
        tiled = best_ms(lambda: kernels.prefill_attention(q, kc, vc, chunks, 0.125, out), args.repeats)
        per_token = best_ms(lambda: kernels.paged_attention(q, kc, vc, items, 0.125, out), args.repeats)
        torch_path = best_ms(lambda: sdpa.attend(q, kc, vc, meta, 0.125), args.repeats)
        gflops = causal_flops(query_lens, context_lens) / tiled / 1e6
        print(f"{label:<52} {tiled:>8.2f} {per_token:>10.2f} {torch_path:>8.2f}  {gflops:.0f}")


if __name__ == "__main__":
    main()
