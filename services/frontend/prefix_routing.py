"""Which scheduler group a request should go to, by the prefix of its prompt each group holds.

Exactly, while every group's cache stream is up (order_by_cache): each scheduler reports its
prefix cache's blocks and its load to every frontend (services/scheduler/cache_feed.py), so all
frontends see the same truth. A prompt goes to the group holding the longest run of its leading
blocks among the groups within a bounded load: at most BALANCE times the mean load (requests
running and waiting, this one included), so a hot prefix spreads over more groups as its load
grows instead of piling onto one. Equal matches go to the least loaded.

A request under a LoRA adapter goes, within the same bound, to a group where the adapter is
active (some request there uses it, so it holds it in a slot): a new group takes the adapter on
only when those are all past the bound, so an adapter spreads over more groups as its load
grows, and moving into a group with a free slot rather than evicting one another adapter holds.
The spread is bounded: an adapter is taken on by at most all groups but one, past which its
requests queue at the least loaded of its groups, so one hot adapter never has every group.

Approximately, when a stream is down (PrefixRouter): a frontend cannot see that group's cache,
but it knows which prompts it sent where: for each group it keeps the hashes of the leading
chunks of those prompts (a chain, so a chunk's hash stands for the whole prefix up to it), least
recently used first out. A new prompt goes to the group that has seen the longest run of its
leading chunks; groups that match equally are told apart by load. A group that has become much
busier than the least busy one is passed over (the overload escape). Chunks are a fixed number
of tokens, independent of the schedulers' KV block size: the table only estimates where a prefix
is likely cached, and a longer chunk keeps it smaller.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol, TypeVar

from vmesh.services.common.cache_events import CacheView
from vmesh.services.common.prefix_hash import adapter_root, chained_block_hashes
from vmesh.services.common.runtime.peers import Member

CHUNK_TOKENS = 32
MAX_CHUNKS = 128  # prefixes are told apart by at most their first 4,096 tokens
TABLE_ENTRIES = 1 << 16  # chunk hashes remembered per group (~4 MiB per group)
OVERLOAD_SLACK = 4  # in-flight requests a preferred group may have beyond twice the least busy's
BALANCE = 1.25  # exact routing: a group takes a request only while its load stays within this of the mean


G = TypeVar("G", bound=Member)


class Watched(Protocol):
    """A group whose cache stream is up: its view."""
    address: str

    @property
    def cache(self) -> CacheView | None: ...


W = TypeVar("W", bound=Watched)


def prefix_hashes(prompt: Sequence[int], lora_name: str = "") -> list[int]:
    """Chained hashes of the prompt's leading full chunks, under its LoRA adapter ("": the base
    model): a group caches each adapter's prefixes apart."""
    return chained_block_hashes(prompt, CHUNK_TOKENS, parent=adapter_root(0, lora_name), max_blocks=MAX_CHUNKS)


@dataclass
class PromptRoute:
    """What a group will cache of a request (its prompt, and the outputs it resumes with, under its
    LoRA adapter), hashed for the approximate table only when that is used."""
    tokens: Sequence[int]
    lora_name: str = ""

    @cached_property
    def chunk_hashes(self) -> list[int]:
        return prefix_hashes(self.tokens, self.lora_name)


def order_by_cache(groups: Sequence[W], route: PromptRoute) -> list[W]:
    """`groups` (each with a cache view) in the order to try them: the one holding the longest
    prefix of `route` among those within the load bound first (for an adapter's request, among
    those where it is active, while they are within the bound: `_adapter_candidates`), then the
    rest, least loaded first."""
    views = {group.address: _view(group) for group in groups}
    by_load = sorted(groups, key=lambda group: views[group.address].requests)
    if not by_load:
        return []
    loads = [views[group.address].requests for group in by_load]
    bound = math.ceil(BALANCE * (sum(loads) + 1) / len(loads))  # >= the least loaded's load + 1
    eligible = [group for group, load in zip(by_load, loads, strict=True) if load + 1 <= bound]
    if route.lora_name:
        eligible = _adapter_candidates(by_load, eligible, views, route.lora_name)
    best = max(eligible, key=lambda group: (views[group.address].cached_tokens(route.tokens, route.lora_name),
                                            -views[group.address].requests))
    return [best, *(group for group in by_load if group is not best)]


def _adapter_candidates(by_load: list[W], eligible: list[W], views: dict[str, CacheView], lora_name: str) -> list[W]:
    """Where a request under `lora_name` may go: the groups where the adapter is active, within
    the load bound; else, while it is active in fewer than all groups but one, the eligible groups
    with a slot free for it (any eligible group when none has); else the least loaded of its groups."""
    holders = [group for group in by_load if views[group.address].adapter_requests(lora_name)]
    within = [group for group in holders if group in eligible]
    if within:
        return within
    if holders and len(holders) >= max(1, len(by_load) - 1):
        return holders[:1]
    with_slot = [group for group in eligible if _has_free_slot(views[group.address])]
    return with_slot or eligible


def _has_free_slot(view: CacheView) -> bool:
    return not view.load.max_loras or len(view.active_adapters()) < view.load.max_loras


def _view(group: Watched) -> CacheView:
    if group.cache is None:
        raise ValueError(f"group {group.address} has no cache view")
    return group.cache


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
