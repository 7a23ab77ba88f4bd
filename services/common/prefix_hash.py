"""The chained hash of a token prefix, block by block: the scheduler's prefix cache keys its KV
blocks by it, and the frontend's prefix router remembers which group saw which prompt chunks.
A block's hash covers every token before it, so equal hashes mean equal prefixes. A request
under a LoRA adapter chains from a root of its own (`adapter_root`): the same tokens' KV differs
by adapter, so two adapters (or an adapter and the base model) never share a block."""

from __future__ import annotations

from collections.abc import Sequence


def chained_block_hashes(token_ids: Sequence[int], block_size: int, parent: int, start_block: int = 0,
                         max_blocks: int | None = None) -> list[int]:
    """Hashes of the full blocks of `token_ids` from `start_block` on (at most `max_blocks` of them
    in all), each chained from the one before, the first from `parent`."""
    end = len(token_ids) // block_size
    if max_blocks is not None:
        end = min(end, max_blocks)
    hashes = []
    for i in range(start_block, end):
        parent = hash((parent, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        hashes.append(parent)
    return hashes


def adapter_root(seed: int, lora_name: str) -> int:
    """The parent of a prefix's first block: `seed` for the base model, a hash of it and the
    adapter's name for a LoRA adapter."""
    return hash((seed, "lora", lora_name)) if lora_name else seed
