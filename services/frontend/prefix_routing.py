"""Which scheduler group a request should go to, by the prompt prefixes each group has seen.

A group's prefix cache holds the KV of prompts it computed recently. The frontend cannot see
that cache, but it knows which prompts it sent where: for each group it keeps the hashes of the
leading chunks of those prompts (a chain, so a chunk's hash stands for the whole prefix up to
it), least recently used first out. A new prompt goes to the group that has seen the longest
run of its leading chunks; groups that match equally are told apart by load. A group that has
become much busier than the least busy one is passed over (the overload escape), so that one
popular prefix cannot pile every request onto one group.

Chunks are a fixed number of tokens, independent of the schedulers' KV block size: the table
only estimates where a prefix is likely cached, and a longer chunk keeps it smaller.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TypeVar

from vmesh.services.common.prefix_hash import adapter_root, chained_block_hashes
from vmesh.services.common.runtime.peers import Member

CHUNK_TOKENS = 32
MAX_CHUNKS = 128  # prefixes are told apart by at most their first 4,096 tokens
TABLE_ENTRIES = 1 << 16  # chunk hashes remembered per group (~4 MiB per group)
OVERLOAD_SLACK = 4  # in-flight requests a preferred group may have beyond twice the least busy's


G = TypeVar("G", bound=Member)


def prefix_hashes(prompt: Sequence[int], lora_name: str = "") -> list[int]:
    """Chained hashes of the prompt's leading full chunks, under its LoRA adapter ("": the base
    model): a group caches each adapter's prefixes apart."""
    return chained_block_hashes(prompt, CHUNK_TOKENS, parent=adapter_root(0, lora_name), max_blocks=MAX_CHUNKS)


class PrefixRouter:
    """Per group (by address), the chunk hashes of the prompts routed there."""

    def __init__(self, table_entries: int = TABLE_ENTRIES):
        self.table_entries = table_entries
        self.tables: dict[str, OrderedDict[int, None]] = {}

    def order(self, groups: Sequence[G], hashes: Sequence[int]) -> list[G]:
        """`groups` (the least busy first) in the order to try them: the one most likely to
        hold the prompt's prefix first, unless it is overloaded; then the rest by load."""
        if not groups or not hashes:
            return list(groups)
        least_busy = min(group.in_flight for group in groups)
        best = max(groups, key=lambda group: (self.matched(group.address, hashes), -group.in_flight))
        if self.matched(best.address, hashes) == 0 or best.in_flight > 2 * least_busy + OVERLOAD_SLACK:
            return list(groups)
        return [best, *(group for group in groups if group is not best)]

    def matched(self, group: str, hashes: Sequence[int]) -> int:
        """How many leading chunks of the prompt were routed to `group`."""
        table = self.tables.get(group)
        if not table:
            return 0
        count = 0
        for chunk in hashes:
            if chunk not in table:
                break
            count += 1
        return count

    def routed(self, group: str, hashes: Sequence[int]) -> None:
        """`group` took a prompt with these chunk hashes: it will hold them, the most recent last."""
        table = self.tables.setdefault(group, OrderedDict())
        for chunk in hashes:
            table[chunk] = None
            table.move_to_end(chunk)
        while len(table) > self.table_entries:
            table.popitem(last=False)

    def forget(self, group: str) -> None:
        """The group's cache is gone (its scheduler restarted) or it left."""
        self.tables.pop(group, None)
