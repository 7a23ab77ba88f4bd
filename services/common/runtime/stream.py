"""A stream to one peer, kept open: opened, served until it breaks, reported lost, and opened
again after a backoff, for as long as its task runs (its peer set cancels it when the peer is
let go). The frontend's subscription to a detokenizer replica, the scheduler's Detokenize
stream to one, and the frontend's health watch on a scheduler are each one of these."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from vmesh.services.common.runtime.peers import Peer
from vmesh.services.common.runtime.retry import Backoff

logger = logging.getLogger(__name__)

# session(opened): open the stream, call opened() once it is up, serve it until it breaks.
Session = Callable[[Callable[[], None]], Awaitable[None]]
# on_lost(exc): the stream broke; mark the peer down, settle what it held, and return whether
# to open it again (the peer's own rules say when it is down: see each user).
OnLost = Callable[[Exception], Awaitable[bool]]


class KeptStream:
    def __init__(self, peer: Peer, session: Session, on_lost: OnLost, backoff: Backoff):
        """A session that returns (the peer closed the stream) is a break like any other.
        `backoff` paces the attempts: its count restarts each time a stream came up."""
        self.peer = peer
        self._session = session
        self._on_lost = on_lost
        self.backoff = backoff
        self.failures = 0

    def opened(self) -> None:
        """The session's stream is up: the peer is reachable (start-up need not wait any more)."""
        self.peer.alive = True
        self.failures = 0
        self.peer.joined.set()

    async def run(self) -> None:
        while True:
            try:
                await self._session(self.opened)
                raise ConnectionError("stream closed")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.failures += 1
                if not await self._on_lost(exc):
                    return
            await self.backoff.sleep(self.failures)
