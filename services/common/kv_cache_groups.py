"""KV cache groups: how the layers of a model share the paged KV cache (after vLLM V1's
hybrid KV cache manager).

Layers of one attention kind (global, or a sliding window of W positions) form groups of
equal size; each group has its own block table per request, and every group draws its blocks
from one shared pool. A block is a page of `slots_per_block` layers: layer slot k of a block
belongs to the k-th layer of whichever group the block was given to, so the pool's memory
serves any mix of kinds as requests come and go. A sliding-window group frees the blocks that
fall wholly behind its window while a request runs, which a model with windowed layers turns
into memory for more context (Gemma 3: 5 local layers to 1 global one).

The scheduler plans with the groups' windows (services/scheduler/kv_cache_manager.py), the
worker lays out its cache tensors by the same groups (services/worker/kv_cache.py); the worker
reports the windows, in group order, in GetWorkerInfo.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroup:
    window: int | None  # a sliding window of this many positions; None: global attention
    layers: tuple[int, ...]  # the model's layers in this group; layer k uses slot k of the group's blocks


@dataclass(frozen=True)
class KVCacheLayout:
    groups: tuple[KVCacheGroup, ...]

    @property
    def slots_per_block(self) -> int:
        """Layers one block holds: the largest group's (a smaller group leaves slots unused)."""
        return max(len(group.layers) for group in self.groups)

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(group.window for group in self.groups)

    @property
    def num_layers(self) -> int:
        return sum(len(group.layers) for group in self.groups)

    def group_of_layer(self) -> list[int]:
        owner = [0] * self.num_layers
        for g, group in enumerate(self.groups):
            for layer in group.layers:
                owner[layer] = g
        return owner

    def slot_of_layer(self) -> list[int]:
        slot = [0] * self.num_layers
        for group in self.groups:
            for k, layer in enumerate(group.layers):
                slot[layer] = k
        return slot


def kv_cache_layout(layer_windows: Sequence[int | None], max_model_len: int) -> KVCacheLayout:
    """The groups of a model whose layer i attends within `layer_windows[i]` (None: globally).

    A window of at least max_model_len sees every position a request can have: such a layer is
    global. Each kind's layers (in layer order) are cut into groups of the smallest kind's size,
    so one block's page fits every group; global groups come first (the prefix cache's routing
    feed reads group 0, whose hits are a plain prefix)."""
    windows = [w if w is not None and w < max_model_len else None for w in layer_windows]
    if not windows:
        raise ValueError("a model has at least one layer")
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        kinds.setdefault(window, []).append(layer)
    size = min(len(layers) for layers in kinds.values())
    order = sorted(kinds, key=lambda w: (w is not None, w or 0))
    groups = tuple(KVCacheGroup(window, tuple(kinds[window][i:i + size]))
                   for window in order for i in range(0, len(kinds[window]), size))
    return KVCacheLayout(groups)


def single_group_layout(num_layers: int) -> KVCacheLayout:
    """Every layer global, in one group: the layout of a model without windows."""
    return KVCacheLayout((KVCacheGroup(None, tuple(range(num_layers))),))
