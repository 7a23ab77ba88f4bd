"""A request's KV blocks across the KV cache groups (services/common/kv_cache_groups.py), after
vLLM V1's hybrid KV cache manager.

Every group has one block table per request, aligned on positions: entry i of any group's
table covers tokens [i * block_size, (i + 1) * block_size), so every table has the same
length. A global group holds every entry. A sliding-window group of W holds only the entries
its next query can see: once the request's first uncomputed position is p, the blocks wholly
before p - W + 1 go back to the pool (where, if cached, they stay reusable until evicted), and
their entries keep NO_BLOCK's id, which no attention kernel reads (each skips the blocks
wholly behind a window) and no write reaches (new tokens land after p).

Prefix caching: a hit of k blocks needs every global group's first k blocks and each window
group's blocks that the position k * block_size can see, all cached; the longest such k wins.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from vmesh.services.scheduler.block_pool import BlockPool

# The id a window group's table holds where it keeps no block: a valid id, so a table is a plain
# array of ids, but never read (attention skips blocks behind the window) nor written.
NO_BLOCK = 0


@dataclass
class BlockTables:
    """One request's block table in each group, and how many leading entries of each it does
    not hold (behind the group's window, or never taken on a prefix hit)."""
    ids: list[list[int]]
    skipped: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.skipped:
            self.skipped = [0] * len(self.ids)

    def __len__(self) -> int:
        """Entries per table (equal in every group)."""
        return len(self.ids[0])

    def held(self) -> list[int]:
        """Every block the request holds, group by group."""
        return [block for table, skip in zip(self.ids, self.skipped) for block in table[skip:]]

    def flat(self) -> list[int]:
        """The tables one after the other, as a plan carries them (NewRequest.block_ids)."""
        return [block for table in self.ids for block in table]


class KVCacheManager:
    def __init__(self, pool: BlockPool, windows: Sequence[int | None] = (None,)):
        if not windows:
            raise ValueError("a KV cache has at least one group")
        self.pool = pool
        self.windows = tuple(windows)
        self.num_freed_behind_windows = 0  # blocks given back by running requests' window groups

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def empty_tables(self) -> BlockTables:
        return BlockTables([[] for _ in self.windows])

    # --- prefix cache --------------------------------------------------------------------------

    def cached_prefix(self, token_ids: Sequence[int], hashes: Sequence[int]) -> BlockTables:
        """The longest cached prefix of `hashes` every group can serve, its blocks taken."""
        pool = self.pool
        if not pool.enable_prefix_caching or not hashes:
            return self.empty_tables()
        found = [[pool.find(h, token_ids, i, g) for i, h in enumerate(hashes)] for g in range(self.num_groups)]
        hit = len(hashes)
        for g, window in enumerate(self.windows):
            if window is None:  # a plain prefix
                hit = next((i for i, block in enumerate(found[g][:hit]) if block is None), hit)
        settled = False
        while not settled:  # a shorter hit sees other blocks: every window group checks it again
            settled = True
            for g, window in enumerate(self.windows):
                if window is not None and (shorter := self._window_hit(found[g], window, hit)) < hit:
                    hit, settled = shorter, False
        pool.prefix_queries += len(hashes)
        pool.prefix_hits += hit
        tables = BlockTables([[] for _ in self.windows])
        for g, window in enumerate(self.windows):
            skip = self.first_visible_block(window, hit * pool.block_size)
            blocks = [block for block in found[g][skip:hit] if block is not None]
            assert len(blocks) == hit - skip, "every block of the hit is cached"
            pool.take(blocks)
            tables.ids[g] = [NO_BLOCK] * skip + blocks
            tables.skipped[g] = skip
        return tables

    def _window_hit(self, found: list[int | None], window: int, longest: int) -> int:
        """The longest hit of at most `longest` blocks whose visible blocks (those the next
        position can see through `window`) are all in `found`."""
        run = 0  # cached blocks ending at block k - 1
        best = 0
        for k in range(1, longest + 1):
            run = run + 1 if found[k - 1] is not None else 0
            if run >= k - self.first_visible_block(window, k * self.pool.block_size):
                best = k
        return best

    def first_visible_block(self, window: int | None, position: int) -> int:
        """The first block a query at `position` sees through `window` (0 for global attention)."""
        if window is None:
            return 0
        return max(0, position - window + 1) // self.pool.block_size

    def register(self, tables: BlockTables, index: int, block_hash: int, parent: int | None,
                 tokens: Sequence[int]) -> None:
        """Enter block `index` of every group's table in that group's prefix cache, unless the
        group no longer holds it (freed behind its window: the entry is no block of the request's)."""
        for g, table in enumerate(tables.ids):
            if index >= tables.skipped[g]:
                self.pool.register(table[index], block_hash, parent, tokens, g)

    # --- blocks --------------------------------------------------------------------------------

    def allocate(self, tables: BlockTables, num_entries: int) -> list[list[int]] | None:
        """Grow every table to `num_entries` entries with fresh blocks; the new blocks of each
        group, or None (nothing taken) if the pool has too few free."""
        need = max(0, num_entries - len(tables))
        if not need:
            return [[] for _ in self.windows]
        blocks = self.pool.allocate(need * self.num_groups)
        if blocks is None:
            return None
        new = [blocks[g * need:(g + 1) * need] for g in range(self.num_groups)]
        for table, added in zip(tables.ids, new):
            table += added
        return new

    def free_behind_windows(self, tables: BlockTables, first_position: int) -> int:
        """Return to the pool each window group's blocks that a query at `first_position` or
        later never sees; how many went back."""
        freed = 0
        for g, window in enumerate(self.windows):
            end = min(self.first_visible_block(window, first_position), len(tables))
            start = tables.skipped[g]
            if end > start:
                self.pool.free(tables.ids[g][start:end])
                tables.ids[g][start:end] = [NO_BLOCK] * (end - start)
                tables.skipped[g] = end
                freed += end - start
        self.num_freed_behind_windows += freed
        return freed

    def free(self, tables: BlockTables) -> None:
        """Release every block the tables hold."""
        for table, skip in zip(tables.ids, tables.skipped):
            self.pool.free(table[skip:])

    def blocks_at_most(self, num_tokens: int, chunk: int) -> int:
        """The most blocks one request of `num_tokens` tokens holds at once, computing at most
        `chunk` tokens a step: a window group holds its window and the step's tokens."""
        entries = -(-num_tokens // self.pool.block_size)
        total = 0
        for window in self.windows:
            held = entries if window is None else min(entries, -(-(window - 1 + chunk) // self.pool.block_size) + 1)
            total += held
        return total

    def max_context(self, limit: int, chunk: int) -> int:
        """The longest context (at most `limit`) one request can reach with the whole pool: a
        request must never need more, or preempting every other one could not let it run."""
        if self.blocks_at_most(limit, chunk) <= self.pool.num_blocks:
            return limit
        low, high = 0, limit  # blocks_at_most(low) fits, blocks_at_most(high) does not
        while high - low > 1:
            middle = (low + high) // 2
            if self.blocks_at_most(middle, chunk) <= self.pool.num_blocks:
                low = middle
            else:
                high = middle
        return low
