"""The source of the scheduler's WatchCache streams: its prefix cache's changes and its load,
published to every watching frontend at a fixed cadence (so a step that stores a hundred blocks
is one message, not a hundred). A watcher starts from a snapshot; one that falls too far behind
is dropped, and starts again from a snapshot when it comes back."""

from __future__ import annotations

import asyncio
from collections import Counter, deque

from vmesh.services.common.cache_events import CacheUpdate, SchedulerLoad
from vmesh.services.scheduler.scheduler import Scheduler

PUBLISH_INTERVAL_S = 0.05  # how stale a frontend's view may be: a few steps at most
WATCHER_BACKLOG = 256  # updates a watcher may have unread before it is dropped (~13 s of updates)


class WatcherDropped(Exception):
    """The watcher fell too far behind: its stream ends, and a new one starts from a snapshot."""


class CacheWatcher:
    def __init__(self, first: CacheUpdate, backlog: int = WATCHER_BACKLOG):
        self.pending: deque[CacheUpdate] = deque([first])
        self.backlog = backlog
        self.dropped = False
        self._arrived = asyncio.Event()

    def put(self, update: CacheUpdate) -> None:
        if len(self.pending) >= self.backlog:
            self.dropped = True
            self.pending.clear()
        else:
            self.pending.append(update)
        self._arrived.set()

    async def next(self) -> CacheUpdate:
        while not self.pending:
            if self.dropped:
                raise WatcherDropped(f"more than {self.backlog} cache updates went unread")
            self._arrived.clear()
            await self._arrived.wait()
        return self.pending.popleft()


class CacheFeed:
    def __init__(self, scheduler: Scheduler, incarnation: str):
        self.scheduler = scheduler
        self.incarnation = incarnation
        self.watchers: set[CacheWatcher] = set()
        self._published_load: SchedulerLoad | None = None

    def load(self) -> SchedulerLoad:
        s = self.scheduler
        waiting_tokens = sum(max(0, len(r.prompt_token_ids) - r.num_computed_tokens) for r in s.waiting)
        adapters = Counter(r.lora_name for queue in (s.running, s.waiting) for r in queue if r.lora_name)
        return SchedulerLoad(len(s.running), len(s.waiting), s.pool.stats().usage, waiting_tokens,
                             tuple(sorted(adapters.items())), s.config.max_loras)

    def _update(self, snapshot: bool, stored: list[int], removed: list[int], load: SchedulerLoad) -> CacheUpdate:
        pool = self.scheduler.pool
        return CacheUpdate(snapshot, pool.block_size, pool.hash_seed, stored, removed, load, self.incarnation)

    def watch(self) -> CacheWatcher:
        """A new watcher, its first update the whole cache. The others get the changes before it so
        that from here on one journal serves them all."""
        self.publish()
        self._published_load = self.load()  # what every watcher, this one included, now has
        watcher = CacheWatcher(self._update(True, self.scheduler.pool.watch(), [], self._published_load))
        self.watchers.add(watcher)
        return watcher

    def unwatch(self, watcher: CacheWatcher) -> None:
        self.watchers.discard(watcher)
        if not self.watchers:
            self.scheduler.pool.journal = None

    def publish(self) -> None:
        """Send the watchers what changed since the last publish (nothing when nothing did)."""
        if not self.watchers:
            return
        stored, removed = self.scheduler.pool.read_journal()
        load = self.load()
        if not stored and not removed and load == self._published_load:
            return
        self._published_load = load
        update = self._update(False, stored, removed, load)
        for watcher in list(self.watchers):
            watcher.put(update)
            if watcher.dropped:
                self.unwatch(watcher)

    async def run(self, interval_s: float = PUBLISH_INTERVAL_S) -> None:
        while True:
            await asyncio.sleep(interval_s)
            self.publish()
