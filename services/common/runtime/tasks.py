"""Background work a service owns: tasks that outlive the call that started them (an abort
sent after its request ended, a channel closing, a link kept open), and waiting for work in
flight to end before a server stops."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

DRAIN_POLL_S = 0.05  # how often a drain looks whether the last piece of work has ended


class TaskGroup:
    """Tasks referenced until they are done (the event loop keeps only weak references, so an
    unreferenced task may vanish mid-way) and cancelled together when their owner closes."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, work: Coroutine[Any, Any, Any]) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def cancel(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    async def settle(self, timeout: float) -> None:
        """Let the tasks finish for up to `timeout` seconds, cancel what is left, and collect every
        outcome (so that none is reported as an exception never retrieved)."""
        tasks = list(self._tasks)
        if not tasks:
            return
        _done, pending = await asyncio.wait(tasks, timeout=timeout)
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[asyncio.Task]:
        return iter(list(self._tasks))


async def wait_until(done: Callable[[], bool], poll_s: float = DRAIN_POLL_S) -> None:
    """Return once `done()` holds, looking every `poll_s`: a drain waiting for the requests in
    flight to end (the server's grace period bounds it)."""
    while not done():
        await asyncio.sleep(poll_s)
