"""Routing on a simulated mesh: scheduler groups (real scheduler cores over stub workers, small
KV pools, their cache feeds) and frontends that route each arriving request, on a hot-prefix
workload. `routing`: "exact" (each frontend's views from the groups' cache streams), "oracle"
(every pool read directly at each decision) or "table" (each frontend's own record of what it
sent where, as when the streams are down). For the routing tests and benchmarks/cache_routing.py.
`serve_adapters`: LoRA requests (one hot adapter, a few cool ones, the base model) over groups
whose workers hold two adapters at once, routed by the groups' streams with or without regard
to their adapters."""

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

    def __init__(self, name: str, frontends: int, max_loras: int = 0):
        self.name = name
        self.scheduler: Scheduler = make_scheduler(num_blocks=96, block_size=BLOCK, max_model_len=512,
                                                   max_num_seqs=6, max_num_batched_tokens=256, max_loras=max_loras)
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


def step_and_publish(mesh: list[Group]) -> None:
    """One step of every group, then each group's cache-stream update (a request arrives every
    third of a step)."""
    for group in mesh:
        group.step()
        group.feed.publish()


def drain(mesh: list[Group]) -> None:
    """Step every group until none has work left."""
    while any(group.scheduler.has_unfinished() for group in mesh):
        for group in mesh:
            group.step()


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
            chosen.cache.sent()
        group = mesh[[g.address for g in frontend.groups].index(chosen.address)]
        group.scheduler.add_request(Request(f"{i % 2}/{i}", prompt, SamplingParams(max_tokens=6, ignore_eos=True)))
        group.taken += 1
        if i % 3 == 2:
            step_and_publish(mesh)
    drain(mesh)
    for group in mesh:
        assert group.scheduler.pool.num_free == group.scheduler.pool.num_blocks  # no leaked KV block
    queried = sum(group.scheduler.pool.prefix_queries for group in mesh)
    hits = sum(group.scheduler.pool.prefix_hits for group in mesh)
    return hits / queried, [group.taken for group in mesh]


HOT_ADAPTER = "hot"


@dataclass
class AdapterRouting:
    """What `serve_adapters` saw: the most groups the hot adapter was active in at once, and how
    many requests went to a group where their adapter was not active (each a slot to fill, maybe
    by evicting another adapter)."""
    most_hot_groups: int = 0
    cold_arrivals: int = 0


def adapter_workload(requests: int = 240, seed: int = 11) -> list[tuple[list[int], str]]:
    """(prompt, adapter): half under the hot adapter, a tenth under each of three others, the rest base."""
    rng = random.Random(seed)
    names = rng.choices([HOT_ADAPTER, "a", "b", "c", ""], [5, 1, 1, 1, 2], k=requests)
    return [([rng.randrange(1, 900) for _ in range(40)], name) for name in names]


def _adapters_active(scheduler: Scheduler) -> set[str]:
    return {r.lora_name for queue in (scheduler.running, scheduler.waiting) for r in queue if r.lora_name}


def serve_adapters(aware: bool, groups: int = 4, requests: int = 240) -> AdapterRouting:
    """The adapter workload through `groups` groups of two adapter slots, arriving 3 per step
    alternately at two frontends that route on the groups' streams: by adapter (`aware`) or as if
    every request were the base model's."""
    mesh = [Group(f"g{i}", frontends=2, max_loras=2) for i in range(groups)]
    frontends = [[G(g.name) for g in mesh] for _ in range(2)]
    seen = AdapterRouting()
    for i, (prompt, name) in enumerate(adapter_workload(requests)):
        views = frontends[i % 2]
        for g, group in zip(views, mesh, strict=True):
            for update in group.watchers[i % 2].pending:
                if g.cache is None:
                    g.cache = CacheView(update)
                else:
                    g.cache.apply(update)
            group.watchers[i % 2].pending.clear()
        chosen = order_by_cache(views, PromptRoute(prompt, name if aware else ""))[0]
        assert chosen.cache is not None
        chosen.cache.sent(name if aware else "")
        group = mesh[[g.address for g in views].index(chosen.address)]
        seen.cold_arrivals += bool(name) and name not in _adapters_active(group.scheduler)
        group.scheduler.add_request(Request(f"{i % 2}/{i}", prompt, SamplingParams(max_tokens=6, ignore_eos=True),
                                            lora_name=name))
        seen.most_hot_groups = max(seen.most_hot_groups,
                                   sum(HOT_ADAPTER in _adapters_active(g.scheduler) for g in mesh))
        if i % 3 == 2:
            step_and_publish(mesh)
    drain(mesh)
    return seen
