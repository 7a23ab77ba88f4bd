"""Sliding-window attention in every backend the worker may pick (the C kernels, the torch
path, and Triton through its interpreter) against vmesh/kernels/reference.py's paged_attention_ref
with the same window: decodes, prefill chunks from an empty context and after cached tokens,
windows shorter than a block, of one block, and longer than some contexts, in float32 and over a
bfloat16 cache."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.support.paged import paired_value_sum_bound, ragged_batch
from vmesh.kernels import reference
from vmesh.services.worker.attention import AttentionMetadata, CpuAttentionBackend, TorchAttentionBackend

# A step of every kind: two decodes (one inside its window, one far past it), a whole prompt longer
# than the window, chunks after cached tokens that cross the window's edge, mid-block.
QUERY_LENS = [1, 1, 70, 9, 33, 2]
CONTEXT_LENS = [3, 140, 0, 30, 77, 15]
WINDOWS = [1, 7, 16, 40, 500]
SHAPES = [(64, 9, 3), (40, 4, 2)]  # (head_dim, heads, kv_heads); 40: the per-token kernel takes every token


@pytest.fixture(scope="module")
def cpu_backend(kernel_cache_dir) -> CpuAttentionBackend:
    return CpuAttentionBackend(kernel_cache_dir)


def _meta(starts, seq_lens, tables) -> AttentionMetadata:
    return AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long), query_start_loc=starts,
                             seq_lens=seq_lens, block_tables=tables, query_lens_cpu=QUERY_LENS,
                             seq_lens_cpu=seq_lens.tolist())


def test_reference_window_is_transformers_mask():
    """The reference's window is transformers' own sliding-window mask (kv > q - window, causal)."""
    from transformers.masking_utils import causal_mask_function, sliding_window_overlay

    q, kc, vc, starts, seq_lens, tables = ragged_batch([12], [0], 2, 1, 16, 4, torch.float32)
    got = reference.paged_attention_ref(q, kc, vc, starts, seq_lens, tables, 0.25, window=5)
    overlay = sliding_window_overlay(5)
    mask = torch.tensor([[causal_mask_function(0, 0, i, j) and overlay(0, 0, i, j) for j in range(12)]
                         for i in range(12)])
    k = kc[tables[0].long()].reshape(-1, 1, 16)[:12, 0]
    v = vc[tables[0].long()].reshape(-1, 1, 16)[:12, 0]
    for h in range(2):
        scores = (q[:, h] @ k.T * 0.25).masked_fill(~mask, float("-inf"))
        torch.testing.assert_close(got[:, h], scores.softmax(-1) @ v, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(("head_dim", "heads", "kv_heads"), SHAPES)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_cpu_and_torch_backends_match_reference_with_a_window(cpu_backend, head_dim, heads, kv_heads, window,
                                                              cache_dtype):
    q, kc, vc, starts, seq_lens, tables = ragged_batch(QUERY_LENS, CONTEXT_LENS, heads, kv_heads, head_dim, 16,
                                                       torch.float32, seed=window)
    kc, vc = kc.to(cache_dtype), vc.to(cache_dtype)
    if cache_dtype == torch.bfloat16:  # the bfloat16 mode's queries are bfloat16 values (rotary_write_kv_bf16)
        q = q.bfloat16().float()
    want = reference.paged_attention_ref(q, kc, vc, starts, seq_lens, tables, 0.125, window=window)
    unwindowed = reference.paged_attention_ref(q, kc, vc, starts, seq_lens, tables, 0.125)
    if window < 100:
        assert not torch.allclose(want, unwindowed, atol=1e-3), "the window must matter in this batch"
    for backend in (cpu_backend, TorchAttentionBackend()):
        got = backend.attend(q, kc, vc, _meta(starts, seq_lens, tables), 0.125, window=window)
        kernels = cpu_backend.kernels
        if backend is cpu_backend and cache_dtype == torch.bfloat16 and kernels.bf16_dot:
            # With bfloat16 pair dots the value sums take bfloat16 softmax weights: the prefill kernel's
            # always, the decode kernel's where head_dim is 64 or 128; the rest stay float32's.
            decode_rows = torch.tensor(QUERY_LENS) == 1
            decodes = starts[:-1][decode_rows].long()
            paired = torch.ones(len(got), dtype=torch.bool)
            if head_dim not in (64, 128):
                paired[decodes] = False
            if not kernels.supports_prefill(kc):
                paired[~torch.isin(torch.arange(len(got)), decodes)] = False
            torch.testing.assert_close(got[~paired], want[~paired], atol=2e-5, rtol=2e-5)
            assert (got - want).abs().max().item() <= paired_value_sum_bound(vc)
            continue
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5, msg=lambda m, b=backend.name: f"{b}: {m}")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("window", [1, 7, 40])
def test_triton_unified_attention_matches_reference_with_a_window(monkeypatch, window):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from vmesh.kernels.paged_attention import unified_attention

    query_lens, context_lens = [7, 5, 1, 1, 20], [0, 19, 33, 4, 45]
    q, kc, vc, starts, seq_lens, tables = ragged_batch(query_lens, context_lens, 4, 2, 32, 8, torch.float32,
                                                       seed=window)
    got = unified_attention(q, kc, vc, starts, seq_lens, tables, 0.2, max_query_len=max(query_lens), block_m=4,
                            window=window)
    want = reference.paged_attention_ref(q, kc, vc, starts, seq_lens, tables, 0.2, window=window)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_kernels_refuse_a_window_below_one(cpu_backend):
    backend = cpu_backend
    q, kc, vc, _starts, seq_lens, tables = ragged_batch([1], [3], 4, 2, 64, 16, torch.float32)
    rows = torch.arange(1)
    items = backend.kernels.attention_items(tables, rows, rows, seq_lens)
    with pytest.raises(ValueError, match="at least 1 token"):
        backend.kernels.paged_attention(q, kc, vc, items, 0.1, torch.empty_like(q), 0)
