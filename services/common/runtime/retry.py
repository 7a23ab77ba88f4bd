"""How long to wait before trying a peer again, as one policy object that its user is given
(so a test passes `Backoff.none()` instead of patching a module's delay)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    """The wait after the n-th failure in a row: `initial_s * factor ** (n - 1)`, at most `max_s`.
    The default factor of 1 is a fixed delay."""
    initial_s: float
    factor: float = 1.0
    max_s: float | None = None

    @classmethod
    def none(cls) -> Backoff:
        """Try again at once (still yielding to the event loop): for tests."""
        return cls(0.0)

    def delay(self, failures: int = 1) -> float:
        """Seconds to wait after `failures` failures in a row (0 or 1: the first wait)."""
        delay = self.initial_s * self.factor ** max(0, failures - 1)
        return delay if self.max_s is None else min(self.max_s, delay)

    async def sleep(self, failures: int = 1) -> None:
        await asyncio.sleep(self.delay(failures))
