# ruff: noqa: B023  (each lambda is timed inside the iteration that defines it)
"""Times each Triton kernel against its torch reference and PyTorch's
scaled_dot_product_attention on realistic shapes, and prints achieved memory bandwidth as a
fraction of the device's peak. Needs a CUDA device (interpreter timings mean nothing).

    .venv/bin/python -m benchmarks.kernels [--peak-gbps 4800] [--dtype float16]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from vmesh.kernels import reference

# Peak HBM bandwidth of known devices, GB/s; override with --peak-gbps.
PEAK_GBPS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "L4": 300.0}


def timed(fn, repeats: int = 50) -> float:
    """Median milliseconds of fn() on the current CUDA stream."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def decode_batch(batch: int, context: int, heads: int, kv_heads: int, head_dim: int, block_size: int, dtype):
    blocks_per = -(-context // block_size)
    num_blocks = batch * blocks_per
    kc = torch.randn((num_blocks, block_size, kv_heads, head_dim), dtype=dtype, device="cuda")
    vc = torch.randn_like(kc)
    tables = torch.randperm(num_blocks, device="cuda").view(batch, blocks_per).to(torch.int32)
    q = torch.randn((batch, heads, head_dim), dtype=dtype, device="cuda")
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    starts = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    return q, kc, vc, starts, seq_lens, tables


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peak-gbps", type=float, default=None)
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA device", file=sys.stderr)
        return 2
    from vmesh.kernels.fused_ops import rms_norm, silu_and_mul
    from vmesh.kernels.kv_cache_write import write_kv
    from vmesh.kernels.paged_attention import split_kv_decode_attention, unified_attention

    dtype = getattr(torch, args.dtype)
    name = torch.cuda.get_device_name()
    peak = args.peak_gbps or next((v for k, v in PEAK_GBPS.items() if k in name), None)
    element = torch.empty((), dtype=dtype).element_size()
    rows = []

    def record(label: str, ms: float, bytes_moved: int, baseline: str, baseline_ms: float) -> None:
        gbps = bytes_moved / ms / 1e6
        rows.append({"kernel": label, "ms": ms, "GB/s": gbps, "peak_fraction": gbps / peak if peak else None,
                     "baseline": baseline, "baseline_ms": baseline_ms, "speedup": baseline_ms / ms})

    heads, kv_heads, head_dim, block = 32, 8, 128, 16  # Llama-3-8B-like attention
    for batch, context in [(64, 1024), (8, 8192), (1, 32768)]:
        q, kc, vc, starts, seq_lens, tables = decode_batch(batch, context, heads, kv_heads, head_dim, block, dtype)
        kv_bytes = 2 * batch * context * kv_heads * head_dim * element
        scale = head_dim ** -0.5
        # SDPA on contiguous K/V (no paging): the unpaged baseline.
        k_dense = torch.randn((batch, kv_heads, context, head_dim), dtype=dtype, device="cuda")
        v_dense = torch.randn_like(k_dense)
        q_dense = q.view(batch, heads, 1, head_dim)
        sdpa_ms = timed(lambda: F.scaled_dot_product_attention(q_dense, k_dense, v_dense, scale=scale,
                                                               enable_gqa=True))
        ms = timed(lambda: unified_attention(q, kc, vc, starts, seq_lens, tables, scale, max_query_len=1))
        record(f"unified decode b={batch} ctx={context}", ms, kv_bytes, "sdpa (dense)", sdpa_ms)
        splits = min(16, -(-context // 512))
        ms = timed(lambda: split_kv_decode_attention(q, kc, vc, seq_lens, tables, scale, splits))
        record(f"split-kv decode b={batch} ctx={context} splits={splits}", ms, kv_bytes, "sdpa (dense)", sdpa_ms)

    # Prefill chunk: 4 requests x 512 new tokens after 512 cached.
    q, kc, vc, _, _, tables = decode_batch(4, 1024, heads, kv_heads, head_dim, block, dtype)
    q = torch.randn((4 * 512, heads, head_dim), dtype=dtype, device="cuda")
    starts = torch.arange(0, 4 * 512 + 1, 512, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((4,), 1024, dtype=torch.int32, device="cuda")
    ms = timed(lambda: unified_attention(q, kc, vc, starts, seq_lens, tables, head_dim ** -0.5, max_query_len=512),
               repeats=20)
    ref_ms = timed(lambda: reference.paged_attention_ref(q, kc, vc, starts, seq_lens, tables, head_dim ** -0.5),
                   repeats=5)
    prefill_bytes = 2 * 4 * 1024 * kv_heads * head_dim * element + 2 * q.numel() * element
    record("unified prefill 4x512 after 512", ms, prefill_bytes, "torch reference", ref_ms)

    tokens = 8192
    key = torch.randn((tokens, kv_heads, head_dim), dtype=dtype, device="cuda")
    value = torch.randn_like(key)
    kc = torch.zeros((tokens // block + 1, block, kv_heads, head_dim), dtype=dtype, device="cuda")
    vc = torch.zeros_like(kc)
    slots = torch.randperm(tokens, device="cuda")
    ms = timed(lambda: write_kv(key, value, kc, vc, slots))
    ref_ms = timed(lambda: reference.write_kv_ref(key, value, kc, vc, slots))
    record(f"write_kv {tokens} tokens", ms, 4 * key.numel() * element, "torch reference", ref_ms)

    x = torch.randn((tokens, 4096), dtype=dtype, device="cuda")
    residual = torch.randn_like(x)
    weight = torch.randn(4096, dtype=dtype, device="cuda")
    ms = timed(lambda: rms_norm(x, weight, 1e-5, residual))
    ref_ms = timed(lambda: reference.rms_norm_ref(x, weight, 1e-5, residual))
    record("rms_norm + residual 8192x4096", ms, 4 * x.numel() * element, "torch reference", ref_ms)
    gate_up = torch.randn((tokens, 2 * 14336), dtype=dtype, device="cuda")
    ms = timed(lambda: silu_and_mul(gate_up))
    ref_ms = timed(lambda: reference.silu_and_mul_ref(gate_up))
    record("silu_and_mul 8192x14336", ms, gate_up.numel() * element * 3 // 2, "torch reference", ref_ms)

    print(f"device: {name}; peak {peak} GB/s; dtype {args.dtype}")
    print(f"{'kernel':<44} {'ms':>8} {'GB/s':>8} {'of peak':>8} {'baseline':>16} {'speedup':>8}")
    for r in rows:
        frac = f"{r['peak_fraction']:.2f}" if r["peak_fraction"] else "-"
        print(f"{r['kernel']:<44} {r['ms']:>8.3f} {r['GB/s']:>8.0f} {frac:>8} {r['baseline']:>16} {r['speedup']:>8.2f}")
    print(json.dumps({"device": name, "dtype": args.dtype, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
