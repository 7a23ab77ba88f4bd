"""The KV block pool: preallocated tensors of fixed-size blocks, laid out by KV cache group.

A block is a page of `slots_per_block` layers (services/common/kv_cache_groups.py): there is
one key and one value tensor per slot, and layer i reads and writes slot slot_of_layer[i] of
the blocks in its group's block table. A model without sliding windows has one group of every
layer: one tensor per layer, as a plain paged cache."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from vmesh.kernels.cpu_checks import KV_INT8_SCALE_BYTES
from vmesh.services.common.kv_cache_groups import KVCacheLayout, kv_cache_layout
from vmesh.services.common.model_spec import ModelSpec

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30


def model_kv_layout(spec: ModelSpec, max_model_len: int) -> KVCacheLayout:
    """The KV cache groups of `spec`'s layers, whose windows count up to `max_model_len`."""
    return kv_cache_layout([layer.attention.window for layer in spec.layers], max_model_len)


def cache_row(spec: ModelSpec, dtype: torch.dtype) -> int:
    """Elements of one KV head's row in a cache of `dtype`: head_dim, and an 8-bit cache's scale bytes."""
    return spec.head_dim + (KV_INT8_SCALE_BYTES if dtype == torch.int8 else 0)


def bytes_per_block(spec: ModelSpec, block_size: int, dtype: torch.dtype, layout: KVCacheLayout | None = None) -> int:
    """One block's keys and values in a cache of `dtype`: every layer's without `layout` (one global
    group), else its slots' (each group's layers share the page)."""
    element = torch.empty((), dtype=dtype).element_size()
    slots = spec.num_layers if layout is None else layout.slots_per_block
    return 2 * slots * block_size * spec.num_kv_heads * cache_row(spec, dtype) * element


def kv_cache_dtype(name: str, device: torch.device, model_dtype: torch.dtype,
                   attention_backend: str = "auto") -> torch.dtype:
    """The KV cache's element type for `--kv-cache-dtype name`: auto is the model's dtype; int8 is
    vmesh/kernels/cpu/kv_int8.h's rows, which the CPU's attention kernels (and the torch reference
    backend) read, and the Triton kernels do not."""
    if name == "auto":
        return model_dtype
    if name == "int8":
        if device.type != "cpu":
            raise ValueError(f"--kv-cache-dtype int8 runs on the CPU (its attention kernels are C); on {device} "
                             "use --kv-cache-dtype auto")
        if attention_backend == "triton":
            raise ValueError("--kv-cache-dtype int8 needs the cpu or torch attention backend, not triton")
        return torch.int8
    raise ValueError(f"unknown KV cache dtype {name!r} (auto or int8)")


def kv_cache_budget(device: torch.device, kv_cache_memory: int | None, memory_fraction: float) -> int:
    if kv_cache_memory is not None:
        return kv_cache_memory
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * memory_fraction)
    return DEFAULT_CPU_KV_CACHE_MEMORY


@dataclass
class KVCache:
    # per layer [num_blocks, block_size, kv_heads, head_dim] (slots shared); int8: head_dim + 4 bytes
    key_caches: list[torch.Tensor]
    value_caches: list[torch.Tensor]
    num_blocks: int
    block_size: int
    layout: KVCacheLayout
    group_of_layer: list[int] = field(default_factory=list)  # the KV cache group each layer reads

    def __post_init__(self) -> None:
        if not self.group_of_layer:
            self.group_of_layer = self.layout.group_of_layer()

    @property
    def num_groups(self) -> int:
        return len(self.layout.groups)

    @classmethod
    def allocate(cls, spec: ModelSpec, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, layout: KVCacheLayout) -> KVCache:
        if num_blocks < 1:
            raise ValueError("the KV cache budget does not hold a single block")
        shape = (num_blocks, block_size, spec.num_kv_heads, cache_row(spec, dtype))
        keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layout.slots_per_block)]
        values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layout.slots_per_block)]
        slot = layout.slot_of_layer()
        return cls([keys[s] for s in slot], [values[s] for s in slot], num_blocks, block_size, layout)

    @classmethod
    def from_budget(cls, spec: ModelSpec, budget_bytes: int, block_size: int, device: torch.device,
                    dtype: torch.dtype, max_model_len: int) -> KVCache:
        layout = model_kv_layout(spec, max_model_len)
        per_block = bytes_per_block(spec, block_size, dtype, layout)
        num_blocks = budget_bytes // per_block
        if num_blocks < 1:
            raise ValueError(f"KV cache memory {budget_bytes} B is less than one block ({per_block} B)")
        windows = ", ".join("global" if w is None else f"window {w}" for w in layout.windows)
        logger.info("KV cache: %d blocks of %d tokens x %d layers (%.2f GiB, %s), %d group(s) (%s)", num_blocks,
                    block_size, layout.slots_per_block, num_blocks * per_block / (1 << 30),
                    str(dtype).removeprefix("torch."), len(layout.groups), windows)
        return cls.allocate(spec, num_blocks, block_size, device, dtype, layout)
