"""What the ctypes wrappers in cpu_native.py check before C reads raw pointers: each tensor's
dtype and layout, and a step's attention work, checked once per step and then reused by every
layer's call in O(1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The attention kernels' cache element types (float32 arithmetic in each).
KV_DTYPES = (torch.float32, torch.bfloat16, torch.int8)
# An 8-bit cache's head rows end in their float32 scale (vmesh/kernels/cpu/kv_int8.h): its last
# dimension is head_dim + this many bytes.
KV_INT8_SCALE_BYTES = 4


def cache_head_dim(cache: torch.Tensor) -> int:
    """The head size of a KV cache tensor [blocks, block_size, kv_heads, row]."""
    return cache.shape[3] - KV_INT8_SCALE_BYTES if cache.dtype == torch.int8 else cache.shape[3]


def require_contiguous_cpu(*tensors: tuple[str, torch.Tensor, torch.dtype]) -> None:
    # is_cpu, not device.type: this runs a few hundred times per decode step, and building a
    # torch.device per tensor cost ~1.5 us each.
    for name, t, dtype in tensors:
        if t.dtype != dtype or not t.is_contiguous() or not t.is_cpu:
            raise ValueError(f"{name} must be a contiguous CPU {dtype} tensor, got {t.dtype} "
                             f"(contiguous={t.is_contiguous()}, device={t.device})")


@dataclass(frozen=True)
class AttentionItems:
    """The query tokens the attention kernel answers this step, one entry each: their row of
    block_tables, their row of the query, and how many cached tokens they see."""

    block_tables: torch.Tensor  # [num_reqs, width] int32
    request_rows: torch.Tensor  # [num_items] int64
    token_rows: torch.Tensor  # [num_items] int64
    context_lens: torch.Tensor  # [num_items] int32
    rows_end: int  # one past the last query row read or written
    longest: int  # the longest context, in tokens


@dataclass(frozen=True)
class PrefillChunks:
    """The prefill chunks the tiled kernel answers this step, one entry each: their row of
    block_tables, their first query row, their length, and their request's context length
    once the chunk is in the cache."""

    block_tables: torch.Tensor  # [num_reqs, width] int32
    requests: torch.Tensor  # [num_chunks] int64
    starts: torch.Tensor  # [num_chunks] int64
    lengths: torch.Tensor  # [num_chunks] int32
    seq_lens: torch.Tensor  # [num_chunks] int32
    rows_end: int  # one past the last query row read or written
    longest: int  # the longest context, in tokens


def reach(block_tables: torch.Tensor, requests: torch.Tensor, row_ends: torch.Tensor,
           context_lens: torch.Tensor) -> tuple[int, int]:
    """(rows_end, longest) of a step's work, checked against the block table once per step."""
    if not len(requests):
        return 0, 0
    if int(requests.min()) < 0 or int(requests.max()) >= block_tables.shape[0] or int(row_ends.min()) < 1:
        raise ValueError("request rows must index block_tables, and query rows must be >= 0")
    return int(row_ends.max()), int(context_lens.max())


def attention_shape(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, out: torch.Tensor,
                     work: AttentionItems | PrefillChunks) -> tuple[int, int, int, int]:
    """What both attention kernels check before they read raw pointers, in O(1) per layer;
    returns (block_size, kv_heads, head_dim, query heads per KV head)."""
    if query.dim() != 3 or query.dtype != torch.float32 or query.stride(2) != 1 or query.stride(1) != query.shape[2]:
        raise ValueError("query must be float32 [tokens, heads, head_dim] with each token's heads contiguous")
    if key_cache.dtype not in KV_DTYPES:
        raise ValueError(f"the KV cache must be float32, bfloat16 or int8, got {key_cache.dtype}")
    require_contiguous_cpu(("key_cache", key_cache, key_cache.dtype), ("value_cache", value_cache, key_cache.dtype),
                           ("out", out, torch.float32))
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape or out.shape != query.shape:
        raise ValueError(f"caches {tuple(key_cache.shape)} / {tuple(value_cache.shape)} and out {tuple(out.shape)} "
                         f"do not fit query {tuple(query.shape)}")
    _, block_size, kv_heads, _ = key_cache.shape
    head_dim = cache_head_dim(key_cache)
    if query.shape[2] != head_dim or query.shape[1] % kv_heads:
        raise ValueError(f"query {tuple(query.shape)} does not fit {kv_heads} KV heads of size {head_dim}")
    if work.rows_end > query.shape[0] or work.longest > work.block_tables.shape[1] * block_size:
        raise ValueError(f"the step reaches query row {work.rows_end - 1} and context {work.longest}, beyond "
                         f"{query.shape[0]} rows and {work.block_tables.shape[1] * block_size} tokens of block table")
    return block_size, kv_heads, head_dim, query.shape[1] // kv_heads


def int8_block_weight(packed: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                      block_inputs: int) -> tuple[int, int]:
    """What int8_block_linear (vmesh/kernels/cpu/int8_linear.c) reads of a weight, checked: packed
    uint8 [ceil(out / 16), in / 4, 16, 4], scale and bias float32 [out], in a multiple of
    block_inputs. Returns (out_features, in_features)."""
    require_contiguous_cpu(("packed", packed, torch.uint8), ("scale", scale, torch.float32),
                           *((("bias", bias, torch.float32),) if bias is not None else ()))
    out_features, in_features = scale.shape[0], packed.shape[1] * 4 if packed.dim() > 1 else 0
    if (packed.dim() != 4 or packed.shape[2:] != (16, 4) or -(-out_features // 16) != packed.shape[0]
            or in_features % block_inputs or scale.dim() != 1
            or (bias is not None and bias.shape != scale.shape)):
        raise ValueError(f"packed {tuple(packed.shape)}, scale {tuple(scale.shape)} and bias "
                         f"{None if bias is None else tuple(bias.shape)} do not describe one layer whose width "
                         f"divides by {block_inputs}")
    return out_features, in_features
