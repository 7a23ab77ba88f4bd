"""Rotary position embeddings (non-interleaved halves, as the Llama lineage uses them). Each
layer's plan names its base and scaling (Gemma 3's local and global layers differ)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from vmesh.services.common.families.plan import AttentionPlan


def inverse_frequencies(attention: AttentionPlan, head_dim: int) -> torch.Tensor:
    dim = head_dim
    inv_freq = 1.0 / (attention.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = attention.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        inv_freq = _llama3_scaled(inv_freq, scaling)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, scaling: Mapping[str, Any]) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original_len / low, inv_freq / factor, inv_freq)
    smooth = (original_len / wavelen - low) / (high - low)
    interpolated = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= original_len / high) & (wavelen <= original_len / low)
    return torch.where(in_band, interpolated, scaled)


class RotaryEmbedding:
    def __init__(self, attention: AttentionPlan, head_dim: int, max_positions: int, device: torch.device,
                 dtype: torch.dtype):
        inv_freq = inverse_frequencies(attention, head_dim)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin = emb.sin().to(device=device, dtype=dtype)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin rows for a step's positions, [tokens, 1, d]: gathered once, used by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [tokens, heads, d] (queries and keys may share one call)."""
        return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
