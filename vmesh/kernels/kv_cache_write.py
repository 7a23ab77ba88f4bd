"""Write a step's new keys and values into the paged KV cache through the slot mapping."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
                     stride_key_t, stride_value_t, stride_cache_slot,
                     ROW: tl.constexpr, ROW_PAD: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    if slot < 0:  # padding token: nothing to write
        return
    offs = tl.arange(0, ROW_PAD)
    mask = offs < ROW
    k = tl.load(key_ptr + token * stride_key_t + offs, mask=mask)
    v = tl.load(value_ptr + token * stride_value_t + offs, mask=mask)
    tl.store(key_cache_ptr + slot * stride_cache_slot + offs, k, mask=mask)
    tl.store(value_cache_ptr + slot * stride_cache_slot + offs, v, mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Same contract as vmesh.kernels.reference.write_kv_ref. key/value rows must be contiguous per token."""
    tokens, kv_heads, head_dim = key.shape
    if tokens == 0:
        return
    row = kv_heads * head_dim
    assert key.stride(1) == head_dim and key.stride(2) == 1 and value.stride(1) == head_dim
    _write_kv_kernel[(tokens,)](key, value, key_cache, value_cache, slot_mapping, key.stride(0), value.stride(0),
                                row, ROW=row, ROW_PAD=triton.next_power_of_2(row))
