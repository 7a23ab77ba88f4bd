"""Triton kernels against their torch references, on CPU through the Triton interpreter
(tests/conftest.py sets TRITON_INTERPRET=1 when no GPU is present). Grids are kept tiny."""

from __future__ import annotations

import pytest
import torch

from tests.support.paged import ragged_batch
from vmesh.kernels import reference

triton = pytest.importorskip("triton")
from vmesh.kernels.fused_ops import rms_norm, silu_and_mul  # noqa: E402
from vmesh.kernels.kv_cache_write import write_kv  # noqa: E402
from vmesh.kernels.paged_attention import split_kv_decode_attention, unified_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-5, torch.float16: 2e-3}


CASES = [  # (head_dim, heads, kv_heads, block_size, dtype, device=DEVICE)
    (64, 3, 3, 16, torch.float32),   # GQA ratio 1
    (64, 9, 3, 32, torch.float16),   # ratio 3
    (128, 8, 1, 16, torch.float32),  # ratio 8
    (128, 8, 1, 32, torch.float16),
]


@pytest.mark.parametrize(("head_dim", "heads", "kv_heads", "block_size", "dtype"), CASES)
def test_unified_attention_matches_reference(head_dim, heads, kv_heads, block_size, dtype):
    # A full prefill, a chunk after cached tokens, decodes; contexts end mid-block.
    query_lens, context_lens = [7, 5, 1, 1], [0, 19, 33, 4]
    q, kc, vc, starts, seq_lens, tables = ragged_batch(query_lens, context_lens, heads, kv_heads, head_dim,
                                                       block_size, dtype, device=DEVICE)
    scale = head_dim ** -0.5
    got = unified_attention(q, kc, vc, starts, seq_lens, tables, scale, max_query_len=max(query_lens), block_m=4)
    want = reference.paged_attention_ref(q.cpu(), kc.cpu(), vc.cpu(), starts.cpu(), seq_lens.cpu(), tables.cpu(),
                                         scale)
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize(("head_dim", "heads", "kv_heads", "block_size", "dtype"), CASES[:3])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_split_kv_decode_matches_reference(head_dim, heads, kv_heads, block_size, dtype, num_splits):
    context_lens = [37, 5, 70]  # one request leaves a split empty
    q, kc, vc, starts, seq_lens, tables = ragged_batch([1, 1, 1], context_lens, heads, kv_heads, head_dim,
                                                       block_size, dtype, seed=1, device=DEVICE)
    scale = head_dim ** -0.5
    got = split_kv_decode_attention(q, kc, vc, seq_lens, tables, scale, num_splits=num_splits)
    want = reference.paged_attention_ref(q.cpu(), kc.cpu(), vc.cpu(), starts.cpu(), seq_lens.cpu(), tables.cpu(),
                                         scale)
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_kv_matches_reference_and_skips_padding(dtype):
    g = torch.Generator().manual_seed(2)
    key = torch.randn((6, 3, 64), generator=g).to(dtype)
    value = torch.randn((6, 3, 64), generator=g).to(dtype)
    slots = torch.tensor([5, 17, -1, 0, 31, -1])
    caches = [torch.zeros((2, 16, 3, 64), dtype=dtype) for _ in range(4)]
    write_kv(key.to(DEVICE), value.to(DEVICE), caches[0], caches[1], slots.to(DEVICE))
    reference.write_kv_ref(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0].cpu(), caches[2]) and torch.equal(caches[1].cpu(), caches[3])
    assert caches[0].view(-1, 3, 64)[[1, 2, 3, 4]].abs().sum() == 0  # untouched slots stay zero


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, with_residual):
    g = torch.Generator().manual_seed(3)
    x = torch.randn((5, 96), generator=g).to(dtype)
    residual = torch.randn((5, 96), generator=g).to(dtype) if with_residual else None
    weight = torch.randn(96, generator=g).to(dtype)
    got = rms_norm(x.to(DEVICE), weight.to(DEVICE), 1e-5, residual.to(DEVICE) if with_residual else None)
    want = reference.rms_norm_ref(x, weight, 1e-5, residual)
    for a, b in zip(got if with_residual else [got], want if with_residual else [want]):
        torch.testing.assert_close(a.cpu().float(), b.float(), atol=TOL[dtype] * 5, rtol=TOL[dtype] * 5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_and_mul_matches_reference(dtype):
    x = torch.randn((4, 2 * 80), generator=torch.Generator().manual_seed(4)).to(dtype)
    got = silu_and_mul(x.to(DEVICE), block=32)
    torch.testing.assert_close(got.cpu().float(), reference.silu_and_mul_ref(x).float(), atol=TOL[dtype] * 5,
                               rtol=TOL[dtype] * 5)
