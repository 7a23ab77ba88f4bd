"""The chained hash of a token prefix, block by block: the scheduler's prefix cache keys its KV
blocks by it, and the frontends route by it (each group's exact cache, as its scheduler reports
it, or the prompt chunks a frontend sent there). A block's hash covers every token before it,
so equal hashes mean equal prefixes. A request under a LoRA adapter chains from a root of its own
(`adapter_root`): the same tokens' KV differs by adapter, so two adapters (or an adapter and the
base model) never share a block."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence


def iter_block_hashes(token_ids: Sequence[int], block_size: int, parent: int, start_block: int = 0,
                      max_blocks: int | None = None) -> Iterator[int]:
    """Hashes of the full blocks of `token_ids` from `start_block` on (at most `max_blocks` of them
    in all), each chained from the one before, the first from `parent`; computed as they are read,
    so that a lookup that stops at its first miss hashes no further."""
    end = len(token_ids) // block_size
    if max_blocks is not None:
        end = min(end, max_blocks)
    for i in range(start_block, end):
        parent = hash((parent, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        yield parent


def chained_block_hashes(token_ids: Sequence[int], block_size: int, parent: int, start_block: int = 0,
                         max_blocks: int | None = None) -> list[int]:
    return list(iter_block_hashes(token_ids, block_size, parent, start_block, max_blocks))


def adapter_root(seed: int, lora_name: str) -> int:
    """The parent of a prefix's first block: `seed` for the base model, a hash of it and the
    adapter's name for a LoRA adapter. Only integers are hashed (the name through blake2b), so
    every process computes the same root: a frontend matches a scheduler's cache with it."""
    if not lora_name:
        return seed
    return hash((seed, int.from_bytes(hashlib.blake2b(lora_name.encode(), digest_size=8).digest(), "little")))
