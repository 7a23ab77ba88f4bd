"""The KV block pool: per layer, one preallocated tensor of fixed-size blocks."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from vmesh.services.common.model_spec import ModelSpec

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30


def bytes_per_block(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * element


def kv_cache_budget(device: torch.device, kv_cache_memory: int | None, memory_fraction: float) -> int:
    if kv_cache_memory is not None:
        return kv_cache_memory
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * memory_fraction)
    return DEFAULT_CPU_KV_CACHE_MEMORY


@dataclass
class KVCache:
    key_caches: list[torch.Tensor]  # per layer [num_blocks, block_size, kv_heads, head_dim]
    value_caches: list[torch.Tensor]
    num_blocks: int
    block_size: int

    @classmethod
    def allocate(cls, spec: ModelSpec, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype) -> KVCache:
        if num_blocks < 1:
            raise ValueError("the KV cache budget does not hold a single block")
        shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(spec.num_layers)]
        values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(spec.num_layers)]
        return cls(keys, values, num_blocks, block_size)

    @classmethod
    def from_budget(cls, spec: ModelSpec, budget_bytes: int, block_size: int, device: torch.device,
                    dtype: torch.dtype) -> KVCache:
        per_block = bytes_per_block(spec, block_size, dtype)
        num_blocks = budget_bytes // per_block
        if num_blocks < 1:
            raise ValueError(f"KV cache memory {budget_bytes} B is less than one block ({per_block} B)")
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB), at most %d tokens in flight",
                    num_blocks, block_size, num_blocks * per_block / (1 << 30), num_blocks * block_size)
        return cls.allocate(spec, num_blocks, block_size, device, dtype)
