"""The C elementwise kernels (vmesh/kernels/cpu/fused_ops.c) against vmesh/kernels/reference.py and
RotaryEmbedding, on one row (serial) and on enough rows to take the OpenMP path."""

from __future__ import annotations

import pytest
import torch

from vmesh.kernels.reference import rms_norm_ref, silu_and_mul_ref, write_kv_ref
from vmesh.services.worker.rotary import RotaryEmbedding

ROWS = [1, 7, 300]  # 300 rows crosses PARALLEL_MIN_FLOATS for every op below


@pytest.mark.parametrize("rows", ROWS)
def test_rms_norm_matches_reference(kernels, rows):
    gen = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 576, generator=gen) * 3, torch.randn(576, generator=gen)
    torch.testing.assert_close(kernels.add_rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", ROWS)
def test_add_rms_norm_updates_the_residual_in_place(kernels, rows):
    gen = torch.Generator().manual_seed(rows)
    x, residual, weight = (torch.randn(rows, 576, generator=gen), torch.randn(rows, 576, generator=gen),
                           torch.randn(576, generator=gen))
    want, want_residual = rms_norm_ref(x, weight, 1e-6, residual.clone())
    out, new_residual = kernels.add_rms_norm(x, weight, 1e-6, residual)
    assert new_residual.data_ptr() == residual.data_ptr()
    torch.testing.assert_close(new_residual, want_residual, atol=0, rtol=0)  # one add per element: exact
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", ROWS)
def test_silu_and_mul_matches_reference_across_the_float_range(kernels, rows):
    gen = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 1536, generator=gen) * 8
    gate_up[0, :6] = torch.tensor([-200.0, -87.5, -20.0, 0.0, 20.0, 200.0])  # clamped and saturated ends
    want = silu_and_mul_ref(gate_up)
    got = kernels.silu_and_mul(gate_up)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=2e-6)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 128), (6, 1, 80)])
def test_rotary_write_kv_matches_rotary_then_write(kernels, rows, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(rows + head_dim)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen)
    cos, sin = torch.randn(rows, 1, head_dim, generator=gen), torch.randn(rows, 1, head_dim, generator=gen)
    num_blocks, block_size = -(-rows // 4) + 2, 4
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    value_cache = torch.randn_like(key_cache)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:rows]
    slots[rows // 2] = -1  # skipped: that slot of the caches must stay as it was

    qk = RotaryEmbedding.apply(qkv[:, :(heads + kv_heads) * head_dim].reshape(rows, -1, head_dim), cos, sin)
    want_k, want_v = key_cache.clone(), value_cache.clone()
    write_kv_ref(qk[:, heads:], qkv[:, (heads + kv_heads) * head_dim:].reshape(rows, kv_heads, head_dim), want_k,
                 want_v, slots)

    q = kernels.rotary_write_kv(qkv, heads, kv_heads, cos, sin, key_cache, value_cache, slots)
    assert q.shape == (rows, heads, head_dim) and q.data_ptr() == qkv.data_ptr()
    torch.testing.assert_close(q, qk[:, :heads], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(key_cache, want_k, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(value_cache, want_v, atol=0, rtol=0)


def test_fused_ops_reject_wrong_dtypes_and_shapes(kernels):
    with pytest.raises(ValueError, match="x must be a contiguous CPU torch.float32"):
        kernels.add_rms_norm(torch.randn(2, 8, dtype=torch.float64), torch.randn(8), 1e-5)
    with pytest.raises(ValueError, match="with a weight of"):
        kernels.add_rms_norm(torch.randn(2, 8), torch.randn(7), 1e-5)
    with pytest.raises(ValueError, match="residual .* does not match"):
        kernels.add_rms_norm(torch.randn(2, 8), torch.randn(8), 1e-5, torch.randn(3, 8))
    with pytest.raises(ValueError, match="gate_up must be a contiguous"):
        kernels.silu_and_mul(torch.randn(8, 4).t())
    with pytest.raises(ValueError, match=r"gate_up must be \[rows, 2 \* inter\]"):
        kernels.silu_and_mul(torch.randn(4, 7))
    caches = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    cos = sin = torch.zeros(3, 8)
    with pytest.raises(ValueError, match="do not fit 1 KV heads"):
        kernels.rotary_write_kv(torch.zeros(3, 24), 1, 1, cos, sin, caches[0], torch.zeros(3, 4, 1, 8),
                                torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="qkv must be float32"):
        kernels.rotary_write_kv(torch.zeros(3, 20), 1, 1, cos, sin, *caches, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="slot_mapping must be a contiguous CPU torch.int64"):
        kernels.rotary_write_kv(torch.zeros(3, 24), 1, 1, cos, sin, *caches, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="one row per token"):
        kernels.rotary_write_kv(torch.zeros(3, 24), 1, 1, cos[:2], sin[:2], *caches, torch.zeros(3, dtype=torch.long))
