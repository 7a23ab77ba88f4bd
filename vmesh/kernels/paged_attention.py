"""Paged attention in Triton.

`unified_attention` serves any ragged batch — prefill chunks (possibly after cached tokens)
and decodes together. One program handles up to BLOCK_M query tokens of one request for one
KV head, with all the query heads that share that KV head stacked as rows (GQA: each key
block is loaded once for the whole group). Keys are visited one cache block at a time through
the block table, with an online softmax.

A sliding window (`window`) masks keys more than window - 1 positions behind each query and
skips the cache blocks wholly before a tile's first window.

`split_kv_decode_attention` serves decode-only batches whose contexts are long next to their
count: each request's context is split into segments handled by separate programs, whose
partial results are merged by their log-sum-exp.

Loads are cast to float32 and dots run in float32 ("ieee"), which keeps results close to the
reference in every dtype (and sidesteps the interpreter's wrong bf16 dot).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _unified_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr, scale,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h, stride_c_block, stride_c_slot, stride_c_head, stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, WINDOW: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    m_tile = tl.program_id(2)
    q_start = tl.load(query_start_ptr + req)
    q_len = tl.load(query_start_ptr + req + 1) - q_start
    if m_tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len  # tokens cached before this step's queries

    rows = tl.arange(0, BLOCK_M * GROUP_PAD)
    token = m_tile * BLOCK_M + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_valid = (token < q_len) & (rows % GROUP_PAD < GROUP)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    q = tl.load(q_ptr + (q_start + token)[:, None] * stride_q_t + head[:, None] * stride_q_h + dims[None, :],
                mask=row_valid[:, None] & dim_valid[None, :], other=0.0).to(tl.float32)
    q_pos = context_len + token

    m_i = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    # This tile's last query sees keys up to its own position; later blocks are not needed.
    kv_end = tl.minimum(seq_len, context_len + (m_tile + 1) * BLOCK_M)
    slots = tl.arange(0, BLOCK_SIZE)
    first_block = 0
    if WINDOW > 0:  # the tile's first query sees keys from its position - WINDOW + 1 on
        first_block = tl.maximum(context_len + m_tile * BLOCK_M - WINDOW + 1, 0) // BLOCK_SIZE
    for j in range(first_block, tl.cdiv(kv_end, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + req * stride_bt + j).to(tl.int64)
        kv_offsets = block * stride_c_block + slots[:, None] * stride_c_slot + kv_head * stride_c_head + dims[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=dim_valid[None, :], other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + kv_offsets, mask=dim_valid[None, :], other=0.0).to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        k_pos = j * BLOCK_SIZE + slots
        visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < seq_len)
        if WINDOW > 0:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - WINDOW)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see nothing yet
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + (q_start + token)[:, None] * stride_o_t + head[:, None] * stride_o_h + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])


def unified_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                      max_query_len: int, out: torch.Tensor | None = None, block_m: int = 16,
                      window: int | None = None) -> torch.Tensor:
    """Same contract as vmesh.kernels.reference.paged_attention_ref."""
    _, heads, head_dim = query.shape
    _, block_size, kv_heads, _ = key_cache.shape
    group = heads // kv_heads
    group_pad = triton.next_power_of_2(group)
    # tl.dot wants at least 16 rows: take more query tokens per program when the group is small.
    block_m = max(triton.next_power_of_2(min(block_m, max(max_query_len, 1))), -(-16 // group_pad))
    out = torch.empty_like(query) if out is None else out
    grid = (seq_lens.shape[0], kv_heads, triton.cdiv(max_query_len, block_m))
    _unified_attention_kernel[grid](
        query, key_cache, value_cache, out, block_tables, seq_lens, query_start_loc, scale,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), key_cache.stride(0), key_cache.stride(1),
        key_cache.stride(2), block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_M=block_m, HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size, WINDOW=window or 0)
    return out


@triton.jit
def _split_kv_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, partial_out_ptr, partial_lse_ptr, block_tables_ptr, seq_lens_ptr, scale,
    stride_q_t, stride_q_h, stride_c_block, stride_c_slot, stride_c_head, stride_bt,
    stride_po_r, stride_po_s, stride_po_h, stride_pl_r, stride_pl_s,
    BLOCKS_PER_SPLIT: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    first_block = split * BLOCKS_PER_SPLIT
    g = tl.arange(0, GROUP_PAD)
    head = kv_head * GROUP + g
    g_valid = g < GROUP
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    lse_offsets = partial_lse_ptr + req * stride_pl_r + split * stride_pl_s + head
    if first_block * BLOCK_SIZE >= seq_len:  # an empty split contributes nothing to the merge
        tl.store(lse_offsets, tl.full([GROUP_PAD], float("-inf"), tl.float32), mask=g_valid)
        return
    q = tl.load(q_ptr + req * stride_q_t + head[:, None] * stride_q_h + dims[None, :],
                mask=g_valid[:, None] & dim_valid[None, :], other=0.0).to(tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    slots = tl.arange(0, BLOCK_SIZE)
    last_block = tl.minimum(first_block + BLOCKS_PER_SPLIT, tl.cdiv(seq_len, BLOCK_SIZE))
    for j in range(first_block, last_block):
        block = tl.load(block_tables_ptr + req * stride_bt + j).to(tl.int64)
        kv_offsets = block * stride_c_block + slots[:, None] * stride_c_slot + kv_head * stride_c_head + dims[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=dim_valid[None, :], other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + kv_offsets, mask=dim_valid[None, :], other=0.0).to(tl.float32)
        # Few rows (one token's query group): broadcast-and-sum instead of tl.dot's 16-row minimum.
        scores = tl.sum(q[:, None, :] * k[None, :, :], 2) * scale
        scores = tl.where((j * BLOCK_SIZE + slots)[None, :] < seq_len, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], 1)
        m_i = m_new
    tl.store(partial_out_ptr + req * stride_po_r + split * stride_po_s + head[:, None] * stride_po_h + dims[None, :],
             acc / l_i[:, None], mask=g_valid[:, None] & dim_valid[None, :])
    tl.store(lse_offsets, m_i + tl.log(l_i), mask=g_valid)


@triton.jit
def _merge_splits_kernel(partial_out_ptr, partial_lse_ptr, out_ptr, stride_po_r, stride_po_s, stride_po_h,
                         stride_pl_r, stride_pl_s, stride_o_t, stride_o_h,
                         NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                         HEAD_DIM_PAD: tl.constexpr):
    req = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    lse = tl.load(partial_lse_ptr + req * stride_pl_r + splits * stride_pl_s + head, mask=splits < NUM_SPLITS,
                  other=float("-inf"))
    weights = tl.exp(lse - tl.max(lse, 0))
    weights = weights / tl.sum(weights, 0)
    partial = tl.load(partial_out_ptr + req * stride_po_r + splits[:, None] * stride_po_s + head * stride_po_h
                      + dims[None, :], mask=(splits[:, None] < NUM_SPLITS) & (dims[None, :] < HEAD_DIM), other=0.0)
    partial = tl.where(weights[:, None] > 0, partial, 0.0)  # empty splits hold no values
    out = tl.sum(partial * weights[:, None], 0)
    tl.store(out_ptr + req * stride_o_t + head * stride_o_h + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


def split_kv_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                              seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, num_splits: int,
                              out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode-only attention (one query token per request, row i = request i), each request's
    context cut into `num_splits` segments merged by log-sum-exp."""
    reqs, heads, head_dim = query.shape
    _, block_size, kv_heads, _ = key_cache.shape
    group = heads // kv_heads
    max_blocks = block_tables.shape[1]
    blocks_per_split = -(-max_blocks // num_splits)
    partial_out = torch.empty((reqs, num_splits, heads, head_dim), dtype=torch.float32, device=query.device)
    partial_lse = torch.empty((reqs, num_splits, heads), dtype=torch.float32, device=query.device)
    out = torch.empty_like(query) if out is None else out
    head_dim_pad = triton.next_power_of_2(head_dim)
    _split_kv_decode_kernel[(reqs, kv_heads, num_splits)](
        query, key_cache, value_cache, partial_out, partial_lse, block_tables, seq_lens, scale,
        query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.stride(0), partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        BLOCKS_PER_SPLIT=blocks_per_split, GROUP=group, GROUP_PAD=triton.next_power_of_2(group), HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size)
    _merge_splits_kernel[(reqs, heads)](
        partial_out, partial_lse, out, partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1), out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad)
    return out
