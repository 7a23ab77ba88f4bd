"""Routing on a simulated mesh: scheduler groups (real scheduler cores over stub workers, small
KV pools, their cache feeds) and frontends that route each arriving request, on a hot-prefix
workload. `routing`: "exact" (each frontend's views from the groups' cache streams), "oracle"
(every pool read directly at each decision) or "table" (each frontend's own record of what it
sent where, as when the streams are down). For the routing tests and benchmarks/cache_routing.py."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from tests.support.factories import make_scheduler
from tests.support.stub_worker import StubWorker
from vmesh.services.common.cache_events import CacheUpdate, CacheView, SchedulerLoad
from vmesh.services.common.types import SamplingParams
from vmesh.services.frontend.prefix_routing import PrefixRouter, PromptRoute, order_by_cache, prefix_hashes
from vmesh.services.scheduler.cache_feed import CacheFeed, CacheWatcher
from vmesh.services.scheduler.request import Request
from vmesh.services.scheduler.scheduler import Scheduler

BLOCK = 16


@dataclass
class G:
    address: str
    cache: CacheView | None = None
    in_flight: int = 0


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


def workload(requests: int = 360, seed: int = 7) -> list[list[int]]:
    """Few long shared prefixes (system prompts, documents), many short questions on them; one
    prefix is much hotter than the rest."""
    rng = random.Random(seed)
    prefixes = [[1000 * (p + 1) + i for i in range(160)] for p in range(16)]
    weights = [30, 8, 6, 5, 4, 3, 3, 2, 2, 2, 1, 1, 1, 1, 1, 1]
    return [[*rng.choices(prefixes, weights)[0], *(rng.randrange(1, 900) for _ in range(12))]
            for _ in range(requests)]


def serve(routing: str, groups: int = 3, requests: int = 360) -> tuple[float, list[int]]:
    """The workload through `groups` groups, arriving 3 per step alternately at two frontends.
    Returns the prefix-cache hit rate (blocks found over blocks looked up, all groups) and how many
    requests each group took."""
    mesh = [Group(f"g{i}", frontends=2) for i in range(groups)]
    frontends = [Frontend([G(g.name) for g in mesh]) for _ in range(2)]
    prompts = workload(requests)
    for i, prompt in enumerate(prompts):
        frontend = frontends[i % 2]
        for g, group in zip(frontend.groups, mesh, strict=True):
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
            chosen = order_by_cache(frontend.groups, PromptRoute(prompt))[0]
            assert chosen.cache is not None
            chosen.cache.sent_since_update += 1
        group = mesh[[g.address for g in frontend.groups].index(chosen.address)]
        group.scheduler.add_request(Request(f"{i % 2}/{i}", prompt, SamplingParams(max_tokens=6, ignore_eos=True)))
        group.taken += 1
        if i % 3 == 2:
            for group in mesh:
                group.step()
                group.feed.publish()
    while any(group.scheduler.has_unfinished() for group in mesh):
        for group in mesh:
            group.step()
    for group in mesh:
        assert group.scheduler.pool.num_free == group.scheduler.pool.num_blocks  # no leaked KV block
    queried = sum(group.scheduler.pool.prefix_queries for group in mesh)
    hits = sum(group.scheduler.pool.prefix_hits for group in mesh)
    return hits / queried, [group.taken for group in mesh]
