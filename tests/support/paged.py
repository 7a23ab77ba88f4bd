"""A ragged query batch over a paged KV cache with shuffled blocks, for kernel tests."""

from __future__ import annotations

import torch


def ragged_batch(query_lens, context_lens, heads, kv_heads, head_dim, block_size, dtype, seed=0, device="cpu"):
    """A paged cache whose blocks are shuffled, and a ragged query batch over it."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for q, c in zip(query_lens, context_lens)]
    blocks_per = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per) + 3
    order = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros((len(seq_lens), max(blocks_per)), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per):
        tables[i, :n] = order[used:used + n].to(torch.int32)
        used += n
    shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=g).to(dtype)
    value_cache = torch.randn(shape, generator=g).to(dtype)
    query = torch.randn((sum(query_lens), heads, head_dim), generator=g).to(dtype)
    starts = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    to = {"device": device}
    return (query.to(**to), key_cache.to(**to), value_cache.to(**to), starts.to(**to),
            torch.tensor(seq_lens, dtype=torch.int32, device=device), tables.to(**to))


def paired_value_sum_bound(value_cache: torch.Tensor) -> float:
    """How far the C prefill kernel's output over a bfloat16 cache may be from float32 arithmetic's
    where it has bfloat16 dot products (`kernels.bf16_dot`): its value sums take the softmax weights
    rounded to bfloat16 (relative error <= 2^-9 each) and divide by the rounded weights' own sum, so
    each normalized weight is off by at most about 2 x 2^-9 of itself and the output, a convex
    combination of the values, by at most 2^-8 of the largest value magnitude, plus float32's own
    error."""
    return 2.0 ** -8 * value_cache.float().abs().max().item() + 2e-5
