"""Torch reference implementations of every kernel in this package. They define what the
Triton kernels must compute, and the CPU code path uses them directly."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vmesh.kernels.cpu_checks import KV_INT8_SCALE_BYTES


def quantize_kv_int8_ref(x: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] float -> the 8-bit cache's rows [..., head_dim + KV_INT8_SCALE_BYTES] int8
    (vmesh/kernels/cpu/kv_int8.h): codes round(x * (127 / max|x|)) to nearest even, then the float32
    scale max|x| / 127 in its bytes. A row with a NaN or an infinity gets zero codes and a NaN scale."""
    x = x.float()
    largest = x.abs().amax(-1, keepdim=True)
    finite = torch.isfinite(x).all(-1, keepdim=True)
    # Below 127 / the largest float the inverse would be infinite: such a row is all zeros. The divisions
    # are tensor by tensor: torch multiplies by a scalar divisor's (or numerator's) reciprocal, which is
    # not the correctly rounded quotient C computes, and a code at a tie would round the other way.
    representable = largest > 127.0 / torch.finfo(torch.float32).max
    codes_per_unit = torch.full_like(largest, 127.0)
    inverse = torch.where(finite & representable, codes_per_unit / largest, torch.zeros_like(largest))
    codes = torch.round(torch.where(finite, x, torch.zeros_like(x)) * inverse).to(torch.int8)
    scale = torch.where(finite, largest / codes_per_unit, torch.full_like(largest, float("nan")))
    return torch.cat([codes, scale.contiguous().view(torch.int8)], dim=-1)


def dequantize_kv_int8_ref(rows: torch.Tensor) -> torch.Tensor:
    """The 8-bit cache's rows [..., head_dim + KV_INT8_SCALE_BYTES] -> their float32 values [..., head_dim]."""
    head_dim = rows.shape[-1] - KV_INT8_SCALE_BYTES
    scale = rows[..., head_dim:].contiguous().view(torch.float32)
    return rows[..., :head_dim].float() * scale


def cache_as(cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A KV cache tensor's values (blocks or rows of it) in `dtype`: an 8-bit cache's dequantized."""
    return (dequantize_kv_int8_ref(cache) if cache.dtype == torch.int8 else cache).to(dtype)


def write_kv_ref(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """key/value [tokens, kv_heads, d] -> caches [blocks, block_size, kv_heads, d] at flat slots; -1 skipped.
    An int8 cache ([..., d + KV_INT8_SCALE_BYTES]) takes each row's codes and scale (quantize_kv_int8_ref)."""
    if key_cache.dtype == torch.int8:
        key, value = quantize_kv_int8_ref(key), quantize_kv_int8_ref(value)
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        slot_mapping, key, value = slot_mapping[valid], key[valid], value[valid]
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slot_mapping, value)


def paged_attention_ref(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                        scale: float, window: int | None = None) -> torch.Tensor:
    """Causal attention for a ragged batch over a paged cache, one request at a time, in float32.
    query [tokens, heads, d]; request i owns query rows query_start_loc[i]:[i+1], the last of which
    sits at position seq_lens[i] - 1. window: a query at position p sees only positions
    p - window + 1 ..= p (transformers' sliding window); None: all up to p."""
    out = torch.empty_like(query)
    heads = query.shape[1]
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        q = query[starts[i]:starts[i + 1]].float()
        n = q.shape[0]
        blocks = block_tables[i, :-(-seq_len // block_size)].long()
        k = cache_as(key_cache[blocks], torch.float32).reshape(-1, kv_heads, q.shape[2])[:seq_len]
        v = cache_as(value_cache[blocks], torch.float32).reshape(-1, kv_heads, q.shape[2])[:seq_len]
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(seq_len - n, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        causal = k_pos[None, :] <= q_pos[:, None]
        if window is not None:
            causal &= k_pos[None, :] > q_pos[:, None] - window
        scores = scores.masked_fill(~causal, float("-inf"))
        out[starts[i]:starts[i + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(query.dtype)
    return out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm computed in float32 whatever the dtype; with `residual`, normalises x + residual
    and also returns that sum (the next residual)."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    normed = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return normed if residual is None else (normed, x)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """[tokens, 2 * inter] (gate, up) -> silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
