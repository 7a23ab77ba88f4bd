"""The scheduler's view of the KV cache: a fixed pool of blocks with reference counts, an
O(1) LRU free list and prefix caching by chained block hashes.

A full block's hash covers its parent's hash and its own tokens, so equal hashes mean equal
prefixes; the stored tokens are compared too, so a hash collision is a miss, never a wrong
hit. A freed block keeps its hash and stays reusable until it is evicted, least recently
freed first.

With KV cache groups (services/common/kv_cache_groups.py) every group draws blocks from this
one pool, and each group has its own prefix cache: the same prefix is held once per group, in
different blocks. Group 0 (global attention whenever the model has any) is the one whose changes
the routing feed journals (cache_feed.py).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from vmesh.services.common.prefix_hash import adapter_root, chained_block_hashes


@dataclass
class PoolStats:
    num_blocks: int
    num_free: int
    prefix_queries: int  # blocks looked up
    prefix_hits: int  # blocks found
    evictions: int

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_seed: int | None = None, num_groups: int = 1):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Seeded per process so that hashes cannot be predicted from outside.
        self.hash_seed = hash_seed if hash_seed is not None else int.from_bytes(os.urandom(8), "little")
        self.ref_counts = [0] * num_blocks
        self.free_blocks: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_key: list[tuple[int, tuple[int, ...]] | None] = [None] * num_blocks
        self.block_group = [0] * num_blocks  # the KV cache group whose prefix cache holds the block
        self.cached_by_group: list[dict[int, int]] = [{} for _ in range(num_groups)]  # hash -> block id
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.evictions = 0
        # While the cache is watched (cache_feed.py): block hash -> cached now, the last change
        # of each block since the journal was read; None, at no cost, while nobody watches.
        self.journal: dict[int, bool] | None = None

    @property
    def cached(self) -> dict[int, int]:
        """Group 0's prefix cache: hash -> block id."""
        return self.cached_by_group[0]

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def stats(self) -> PoolStats:
        return PoolStats(self.num_blocks, self.num_free, self.prefix_queries, self.prefix_hits, self.evictions)

    def hash_blocks(self, token_ids: Sequence[int], parent: int | None = None, start_block: int = 0,
                    lora_name: str = "") -> list[int]:
        """Hashes of the full blocks of `token_ids` from `start_block` on, chained from `parent`
        (None: the root of the request's adapter, `lora_name`, "" for the base model)."""
        root = adapter_root(self.hash_seed, lora_name) if parent is None else parent
        return chained_block_hashes(token_ids, self.block_size, root, start_block)

    def lookup_prefix(self, token_ids: Sequence[int], hashes: Sequence[int]) -> list[int]:
        """The cached blocks holding the longest prefix of `hashes`, each taken (ref += 1)."""
        if not self.enable_prefix_caching:
            return []
        found: list[int] = []
        for i, h in enumerate(hashes):
            block = self.find(h, token_ids, i)
            if block is None:
                break
            found.append(block)
        self.prefix_queries += len(hashes)
        self.prefix_hits += len(found)
        self.take(found)
        return found

    def find(self, block_hash: int, token_ids: Sequence[int], index: int, group: int = 0) -> int | None:
        """The block `group` caches for block `index` of `token_ids` (whose chained hash is
        `block_hash`), not taken; None if it has none."""
        block = self.cached_by_group[group].get(block_hash)
        if block is None:
            return None
        key = self.block_key[block]
        bs = self.block_size
        if key is None or key[1] != tuple(token_ids[index * bs:(index + 1) * bs]):
            return None
        return block

    def take(self, blocks: Sequence[int]) -> None:
        """One more reference to each of `blocks` (cached ones found by `find`)."""
        for block in blocks:
            self._take(block)

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks (ref 1), evicting cached free blocks LRU first; None if too few are free."""
        if n > len(self.free_blocks):
            return None
        blocks = []
        for _ in range(n):
            block, _ = self.free_blocks.popitem(last=False)
            self._evict(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        """Release one reference to each block, tail first, so a request's last blocks are
        evicted before its first (the first ones are the likeliest to be shared)."""
        for block in reversed(blocks):
            count = self.ref_counts[block] - 1
            if count < 0:
                raise AssertionError(f"block {block} freed more often than taken")
            self.ref_counts[block] = count
            if count == 0:
                self.free_blocks[block] = None

    def register(self, block: int, block_hash: int, parent: int | None, tokens: Sequence[int],
                 group: int = 0) -> None:
        """Enter a full block (whose KV is computed or being computed) in `group`'s prefix cache."""
        if not self.enable_prefix_caching or self.block_hash[block] is not None:
            return
        cached = self.cached_by_group[group]
        if block_hash in cached:  # the same prefix computed twice: keep the older block
            return
        self.block_hash[block] = block_hash
        self.block_key[block] = (self.hash_seed if parent is None else parent, tuple(tokens))
        self.block_group[block] = group
        cached[block_hash] = block
        if self.journal is not None and group == 0:
            self.journal[block_hash] = True

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no request holds (benchmarks start cold this way; a client
        can drop stale prefixes after swapping weights). Blocks in use keep their hashes: their
        KV is live. Returns how many blocks were forgotten."""
        dropped = [block for block in self.free_blocks if self.block_hash[block] is not None]
        for block in dropped:
            self._forget(block)
        return len(dropped)

    def _take(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free_blocks[block]
        self.ref_counts[block] += 1

    def _evict(self, block: int) -> None:
        if self.block_hash[block] is not None:
            self._forget(block)
            self.evictions += 1

    def _forget(self, block: int) -> None:
        block_hash = self.block_hash[block]
        assert block_hash is not None, "only a cached block is forgotten"
        group = self.block_group[block]
        del self.cached_by_group[group][block_hash]
        self.block_hash[block] = None
        self.block_key[block] = None
        if self.journal is not None and group == 0:
            self.journal[block_hash] = False

    def watch(self) -> list[int]:
        """Start (or go on) journaling the cache's changes; the hashes of every cached block now."""
        if self.journal is None:
            self.journal = {}
        return list(self.cached)

    def read_journal(self) -> tuple[list[int], list[int]]:
        """The blocks entered in and removed from the cache since the journal was last read."""
        journal = self.journal or {}
        if self.journal is not None:
            self.journal = {}
        stored = [block_hash for block_hash, cached in journal.items() if cached]
        return stored, [block_hash for block_hash, cached in journal.items() if not cached]
