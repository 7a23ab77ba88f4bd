"""Waiting in tests for something to happen: the condition is polled until it holds, and the wait
returns the moment it does. The budget is wall time generous enough for a loaded 2-core machine
(where a step of an event loop or a thread's turn can take a while); it is only ever spent in full
by a test that fails."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

BUDGET_S = 30.0
# Between polls: inside an event loop a short sleep also lets every ready callback run (work that
# needs no thread or timer is done after a few rounds); across threads and processes, a longer
# one keeps the poll from taking the CPU the awaited work needs.
LOOP_INTERVAL_S = 0.001
BLOCKING_INTERVAL_S = 0.05


def _never_held(budget_s: float, what: str | Callable[[], str]) -> AssertionError:
    return AssertionError(f"{what if isinstance(what, str) else what()}: not within {budget_s:.0f} s")


async def eventually(condition: Callable[[], T], what: str | Callable[[], str] = "the condition never held",
                     budget_s: float = BUDGET_S, interval_s: float = LOOP_INTERVAL_S) -> T:
    """In an event loop: `condition()`'s first true value, polled between the loop's rounds.
    `what`: the failure's message (a callable: built when it fails, from the state then)."""
    deadline = time.monotonic() + budget_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise _never_held(budget_s, what)
        await asyncio.sleep(interval_s)
    return value


def eventually_blocking(condition: Callable[[], T], what: str | Callable[[], str] = "the condition never held",
                        budget_s: float = BUDGET_S, interval_s: float = BLOCKING_INTERVAL_S) -> T:
    """Outside an event loop (work in another thread or process): as `eventually`, sleeping
    between polls."""
    deadline = time.monotonic() + budget_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise _never_held(budget_s, what)
        time.sleep(interval_s)
    return value
