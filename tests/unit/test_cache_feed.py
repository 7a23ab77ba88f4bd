"""The scheduler's cache stream (cache_feed.py) over a real scheduler core and a stub worker: a
watcher's view, built from a snapshot and the changes after it, always equals the block pool's
cache; a frontend hashing a prompt as the view says finds exactly the blocks the pool would reuse;
the journal costs nothing while nobody watches; a watcher that falls behind is dropped."""
from __future__ import annotations

import asyncio

import pytest

from tests.support.factories import make_scheduler
from tests.support.stub_worker import StubWorker
from vmesh.services.common.cache_events import CacheUpdate, CacheView, SchedulerLoad
from vmesh.services.common.types import SamplingParams
from vmesh.services.common.wire.cache import cache_update_from_proto, cache_update_to_proto
from vmesh.services.scheduler.cache_feed import CacheFeed, CacheWatcher, WatcherDropped
from vmesh.services.scheduler.request import Request
from vmesh.services.scheduler.scheduler import Scheduler

BLOCK = 4


def run(scheduler: Scheduler, worker: StubWorker, requests: list[Request]) -> None:
    for request in requests:
        scheduler.add_request(request)
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        assert plan is not None
        scheduler.update(worker.execute(plan))


def request(rid: str, prompt: list[int], max_tokens: int = 3) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def drain(watcher: CacheWatcher, view: CacheView | None) -> CacheView:
    while watcher.pending:
        update = watcher.pending.popleft()
        if view is None:
            view = CacheView(update)
        else:
            view.apply(update)
    assert view is not None
    return view


def test_a_watchers_view_follows_the_pool_through_stores_evictions_and_a_reset():
    scheduler = make_scheduler(num_blocks=12, block_size=BLOCK, max_num_batched_tokens=64)
    worker = StubWorker(12, BLOCK)
    feed = CacheFeed(scheduler, "one")
    assert scheduler.pool.journal is None  # nobody watches: nothing is journaled
    run(scheduler, worker, [request("a", list(range(10)))])  # 2 full prompt blocks (+ output ones) cached

    watcher = feed.watch()
    view = drain(watcher, None)
    assert view.blocks == set(scheduler.pool.cached) and len(view.blocks) >= 2
    assert (view.block_size, view.hash_seed) == (BLOCK, scheduler.pool.hash_seed)

    run(scheduler, worker, [request(f"b{i}", [100 + i] * 9) for i in range(4)])  # evicts older blocks
    assert scheduler.pool.evictions > 0
    feed.publish()
    view = drain(watcher, view)
    assert view.blocks == set(scheduler.pool.cached)
    assert view.load == SchedulerLoad(0, 0, 0.0, 0)

    scheduler.reset_prefix_cache()
    feed.publish()
    assert drain(watcher, view).blocks == set() == set(scheduler.pool.cached)
    feed.unwatch(watcher)
    assert scheduler.pool.journal is None


def test_the_view_finds_exactly_the_prefix_the_pool_reuses():
    scheduler = make_scheduler(num_blocks=64, block_size=BLOCK, max_num_batched_tokens=64)
    worker = StubWorker(64, BLOCK)
    feed = CacheFeed(scheduler, "one")
    view = drain(feed.watch(), None)
    shared = list(range(50, 70))  # 5 blocks
    run(scheduler, worker, [request("first", [*shared, 1, 2, 3], max_tokens=1)])
    feed.publish()
    view = drain(next(iter(feed.watchers)), view)
    for prompt in ([*shared, 9, 9, 9, 9, 9], shared[:13], [*shared[:8], 0, *shared[9:]], [7, *shared]):
        expected = len(scheduler.pool.lookup_prefix(prompt, scheduler.pool.hash_blocks(prompt))) * BLOCK
        assert view.cached_tokens(prompt) == expected


def test_load_is_reported_and_an_idle_feed_sends_nothing():
    scheduler = make_scheduler(num_blocks=32, block_size=BLOCK, max_num_seqs=1, max_num_batched_tokens=8)
    feed = CacheFeed(scheduler, "one")
    watcher = feed.watch()
    watcher.pending.clear()
    feed.publish()
    assert not watcher.pending  # nothing changed
    for i in range(3):
        scheduler.add_request(request(str(i), list(range(i, i + 10))))
    scheduler.schedule()  # one admitted (max_num_seqs=1), its first 8 tokens (2 blocks) computing
    feed.publish()
    (update,) = watcher.pending
    assert update.load == SchedulerLoad(num_running=1, num_waiting=2, kv_cache_usage=pytest.approx(2 / 32),
                                        num_waiting_prompt_tokens=20)


def test_a_watcher_that_falls_behind_is_dropped_and_the_journal_stops():
    async def main() -> None:
        scheduler = make_scheduler(num_blocks=64, block_size=BLOCK)
        feed = CacheFeed(scheduler, "one")
        watcher = feed.watch()
        watcher.backlog = 3
        for i in range(4):
            scheduler.add_request(request(str(i), [i] * 5))
            feed.publish()
        assert watcher.dropped and not feed.watchers and scheduler.pool.journal is None
        with pytest.raises(WatcherDropped):
            await watcher.next()

    asyncio.run(main())


def test_updates_cross_the_wire_unchanged():
    update = CacheUpdate(True, 16, 2**64 - 1, [-(2**63), 2**63 - 1, 5], [7], SchedulerLoad(3, 4, 0.5, 900), "x")
    assert cache_update_from_proto(cache_update_to_proto(update)) == update


def test_an_adapters_blocks_are_found_only_under_its_name():
    """A LoRA adapter's prefix chains from its own root: a frontend finds the blocks under the
    adapter's name and not under the base model's, as the pool would."""
    scheduler = make_scheduler(num_blocks=64, block_size=BLOCK, max_num_batched_tokens=64, max_loras=2)
    worker = StubWorker(64, BLOCK)
    feed = CacheFeed(scheduler, "one")
    watcher = feed.watch()
    prompt = list(range(200, 217))  # 4 full blocks
    adapted = request("adapted", prompt, max_tokens=1)
    adapted.lora_name = "sql"
    run(scheduler, worker, [adapted])
    feed.publish()
    view = drain(watcher, None)
    pool = scheduler.pool
    assert view.cached_tokens(prompt, "sql") == 16 == BLOCK * len(
        pool.lookup_prefix(prompt, pool.hash_blocks(prompt, lora_name="sql")))
    assert view.cached_tokens(prompt) == 0 == len(pool.lookup_prefix(prompt, pool.hash_blocks(prompt)))
    assert view.cached_tokens(prompt, "other") == 0
