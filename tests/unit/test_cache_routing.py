"""Exact routing (prefix_routing.order_by_cache) over the views every scheduler's cache stream
gives every frontend: the rule itself, then three groups (real scheduler cores, stub workers,
small KV pools) and two frontends on a hot-prefix workload, against an oracle that reads every
pool directly and against the per-frontend tables used when the streams are down."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from tests.support.factories import make_scheduler
from tests.support.stub_worker import StubWorker
from vmesh.services.common.cache_events import CacheUpdate, CacheView, SchedulerLoad
from vmesh.services.common.prefix_hash import chained_block_hashes
from vmesh.services.common.types import SamplingParams
from vmesh.services.frontend.prefix_routing import PrefixRouter, order_by_cache, prefix_hashes
from vmesh.services.scheduler.cache_feed import CacheFeed, CacheWatcher
from vmesh.services.scheduler.request import Request
from vmesh.services.scheduler.scheduler import Scheduler

BLOCK = 16
SEED = 12345


@dataclass
class G:
    address: str
    cache: CacheView | None = None
    in_flight: int = 0


def view(prompts: list[list[int]], running: int) -> CacheView:
    blocks = [h for p in prompts for h in chained_block_hashes(p, BLOCK, SEED)]
    return CacheView(CacheUpdate(True, BLOCK, SEED, blocks, [], SchedulerLoad(num_running=running)))


def test_the_longest_cached_prefix_within_the_load_bound_goes_first():
    shared = list(range(64))
    a = G("a", view([shared[:32]], running=2))
    b = G("b", view([shared], running=2))
    c = G("c", view([], running=1))
    assert order_by_cache([a, b, c], [*shared, 1]) == [b, c, a]  # b holds 4 blocks; then by load
    b.cache = view([shared], running=5)  # the bound: ceil(1.25 * (2 + 5 + 1 + 1) / 3) = 4 requests
    assert order_by_cache([a, b, c], [*shared, 1]) == [a, c, b]  # b would pass it: a holds the most of the rest
    assert order_by_cache([a, b, c], [999] * 40) == [c, a, b]  # nothing cached anywhere: least loaded
    a.cache.sent_since_update = 3  # this frontend's own sends since a's report count as load
    assert order_by_cache([a, b, c], [*shared, 1])[0] is c  # bound 5: only c stays within it


class Group:
    """A scheduler core with a stub worker, its cache feed, and one watcher per frontend."""

    def __init__(self, name: str, frontends: int):
        self.name = name
        self.scheduler: Scheduler = make_scheduler(num_blocks=96, block_size=BLOCK, max_model_len=512,
                                                   max_num_seqs=6, max_num_batched_tokens=256)
        self.worker = StubWorker(96, BLOCK)
        self.feed = CacheFeed(self.scheduler, name)
        self.watchers: list[CacheWatcher] = [self.feed.watch() for _ in range(frontends)]
        self.taken = 0

    def step(self) -> None:
        plan = self.scheduler.schedule()
        if plan is not None:
            self.scheduler.update(self.worker.execute(plan))

    def truth(self) -> CacheView:
        """What an oracle knows: the pool and the queues as they are this instant."""
        s = self.scheduler
        return CacheView(CacheUpdate(True, BLOCK, s.pool.hash_seed, list(s.pool.cached), [],
                                     SchedulerLoad(len(s.running), len(s.waiting))))


@dataclass
class Frontend:
    groups: list[G]
    table: PrefixRouter = field(default_factory=PrefixRouter)


def workload(seed: int = 7) -> list[list[int]]:
    """Few long shared prefixes (system prompts, documents), many short questions on them; a few
    prefixes are much hotter than the rest."""
    rng = random.Random(seed)
    prefixes = [[1000 * (p + 1) + i for i in range(160)] for p in range(16)]
    weights = [30, 8, 6, 5, 4, 3, 3, 2, 2, 2, 1, 1, 1, 1, 1, 1]
    return [[*rng.choices(prefixes, weights)[0], *(rng.randrange(1, 900) for _ in range(12))] for _ in range(360)]


def serve(routing: str) -> tuple[float, list[int]]:
    """The workload through three groups, arriving 3 per step alternately at two frontends.
    Returns the prompt-token hit rate over all groups and how many requests each group took."""
    groups = [Group(f"g{i}", frontends=2) for i in range(3)]
    frontends = [Frontend([G(g.name) for g in groups]) for _ in range(2)]
    prompts = workload()
    for i, prompt in enumerate(prompts):
        frontend = frontends[i % 2]
        for g, group in zip(frontend.groups, groups, strict=True):
            if routing == "exact":
                for update in group.watchers[i % 2].pending:
                    if g.cache is None:
                        g.cache = CacheView(update)
                    else:
                        g.cache.apply(update)
                group.watchers[i % 2].pending.clear()
            elif routing == "oracle":
                g.cache = group.truth()
            else:
                g.in_flight = sum(1 for r in group.scheduler.requests.values() if not r.is_finished
                                  and r.request_id.startswith(f"{i % 2}/"))  # its own requests only
        if routing == "table":
            hashes = prefix_hashes(prompt)
            chosen = frontend.table.order(sorted(frontend.groups, key=lambda g: g.in_flight), hashes)[0]
            frontend.table.routed(chosen.address, hashes)
        else:
            chosen = order_by_cache(frontend.groups, prompt)[0]
            assert chosen.cache is not None
            chosen.cache.sent_since_update += 1
        group = groups[[g.address for g in frontend.groups].index(chosen.address)]
        group.scheduler.add_request(Request(f"{i % 2}/{i}", prompt, SamplingParams(max_tokens=6, ignore_eos=True)))
        group.taken += 1
        if i % 3 == 2:
            for group in groups:
                group.step()
                group.feed.publish()
    while any(group.scheduler.has_unfinished() for group in groups):
        for group in groups:
            group.step()
    for group in groups:
        assert group.scheduler.pool.num_free == group.scheduler.pool.num_blocks  # no leaked KV block
    queried = sum(group.scheduler.pool.prefix_queries for group in groups)
    hits = sum(group.scheduler.pool.prefix_hits for group in groups)
    return hits / queried, [group.taken for group in groups]


def test_exact_views_route_as_well_as_an_oracle_and_keep_the_groups_balanced():
    oracle_hits, _ = serve("oracle")
    exact_hits, taken = serve("exact")
    table_hits, _ = serve("table")
    assert exact_hits >= 0.9 * oracle_hits, (exact_hits, oracle_hits)
    assert max(taken) <= 1.5 * min(taken), taken
    # Two frontends' own tables each see half the traffic: the shared exact view does better.
    print(f"hit rate: oracle {oracle_hits:.3f}, exact {exact_hits:.3f}, tables {table_hits:.3f}; taken {taken}")
    assert exact_hits > table_hits, (exact_hits, table_hits)
