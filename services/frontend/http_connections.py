"""Guards on the HTTP API's connections, which clients hold at no cost to themselves: a request's
head (request line and headers) must arrive within a timeout, and its body within another, one
peer address may hold only so many connections, and past the public limit every path but the
exempt ones (health, metrics) is answered 503, so that probes still reach the frontend while
clients flood it.

The frontend serves everything on one event loop, so a flood must never cost one loop turn much:
connections are accepted a few per turn (the kernel's listen queue holds the rest), and
connections that missed a deadline are closed a bounded batch per turn; thousands opened or
timed out at once then cost many short turns, between which other clients are served."""

from __future__ import annotations

import asyncio
import socket
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from vmesh.services.frontend.http_middleware import error_response
from vmesh.services.frontend.settings import DEFAULT_HTTP_BODY_TIMEOUT_S

EXEMPT_PATHS = frozenset({"/health", "/metrics"})
# uvicorn hands its backlog to asyncio, which accepts up to that many connections in one loop turn
# and builds a protocol for each; the listen queue is deepened again once the server is up.
ACCEPTS_PER_LOOP_TURN = 16
LISTEN_BACKLOG = 4096  # the kernel caps it at net.core.somaxconn
CLOSES_PER_LOOP_TURN = 32


class BoundedCloser:
    """Closes transports at most CLOSES_PER_LOOP_TURN per event-loop turn, oldest first: a
    connection's deadline passing is no reason to answer within the same turn, and a thousand
    deadlines that pass together would otherwise stall every other client for that turn."""

    def __init__(self) -> None:
        self.pending: deque[asyncio.Transport] = deque()
        self.scheduled = False

    def close(self, transport: asyncio.Transport) -> None:
        transport.pause_reading()  # nothing more of it is read (no request starts) while it waits
        self.pending.append(transport)
        if not self.scheduled:
            self.scheduled = True
            asyncio.get_running_loop().call_soon(self._close_some)

    def _close_some(self) -> None:
        for _ in range(min(CLOSES_PER_LOOP_TURN, len(self.pending))):
            transport = self.pending.popleft()
            if not transport.is_closing():
                transport.abort()  # no graceful TLS shutdown: a late connection gets no more of our time
        self.scheduled = bool(self.pending)
        if self.scheduled:
            asyncio.get_running_loop().call_soon(self._close_some)


@dataclass
class ConnectionGuard:
    """`head_timeout_s`: how long a connection may take to send a request's head, from its
    opening or from the previous response; `per_peer`: connections one peer address may hold (0:
    any number); `limit`: connections, or requests in progress, past which only EXEMPT_PATHS are
    served; `body_timeout_s`: how long a request's body may take to arrive, from its head."""

    head_timeout_s: float
    per_peer: int
    limit: int
    body_timeout_s: float = DEFAULT_HTTP_BODY_TIMEOUT_S
    open: int = 0
    awaiting_head: int = 0  # open connections that have not sent a request's head yet
    in_progress: int = 0
    by_peer: Counter[str] = field(default_factory=Counter)
    closer: BoundedCloser = field(default_factory=BoundedCloser)

    def protocol(self) -> type[H11Protocol]:
        """uvicorn's HTTP/1.1 protocol class under this guard (uvicorn builds one per connection)."""
        guard = self

        class Guarded(GuardedProtocol):
            pass

        Guarded.guard = guard
        return Guarded

    @property
    def over_limit(self) -> bool:
        # A connection still sending its head is bounded by the head timeout and the per-peer cap,
        # not by this limit: counted here, a slow-header flood would deny everyone else service.
        return self.open - self.awaiting_head > self.limit or self.in_progress >= self.limit


class GuardedProtocol(H11Protocol):
    guard: ConnectionGuard

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.peer: str | None = None
        self.head_timer: asyncio.TimerHandle | None = None
        self.body_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        guard = self.guard
        guard.open += 1
        self.peer = self.client[0] if self.client else ""
        guard.by_peer[self.peer] += 1
        if guard.per_peer and guard.by_peer[self.peer] > guard.per_peer:
            guard.closer.close(transport)  # before it can cost a request
            return
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_arrived()
        self._body_arrived()
        guard = self.guard
        if self.peer is not None:
            guard.open -= 1
            guard.by_peer[self.peer] -= 1
            if not guard.by_peer[self.peer]:
                del guard.by_peer[self.peer]
            self.peer = None
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # a request line and its headers are in
            self._head_arrived()
        if self.conn.their_state is h11.SEND_BODY:  # ... and its body is on its way
            self._await_body()
        else:
            self._body_arrived()

    def on_response_complete(self) -> None:
        self._await_head()  # the next request's head, on a kept-alive connection
        super().on_response_complete()

    def _await_head(self) -> None:
        self._head_arrived()
        if not self.transport.is_closing():
            self.head_timer = self.loop.call_later(self.guard.head_timeout_s, self._head_late)
            self.guard.awaiting_head += 1

    def _head_arrived(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None
            self.guard.awaiting_head -= 1

    def _head_late(self) -> None:
        self.head_timer = None
        self.guard.awaiting_head -= 1
        if not self.transport.is_closing():
            self.guard.closer.close(self.transport)

    def _await_body(self) -> None:
        """From the head on, one deadline for the whole body (not one per read, which a client
        sending a byte just in time would never miss)."""
        if self.body_timer is None and not self.transport.is_closing():
            self.body_timer = self.loop.call_later(self.guard.body_timeout_s, self._body_late)

    def _body_arrived(self) -> None:
        if self.body_timer is not None:
            self.body_timer.cancel()
            self.body_timer = None

    def _body_late(self) -> None:
        self.body_timer = None
        if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            self.guard.closer.close(self.transport)  # the app reading the body sees the client gone


class ConnectionLimitMiddleware:
    """Past the guard's limit, a 503 for every path but the exempt ones; counts requests in progress."""

    def __init__(self, app: Any, guard: ConnectionGuard):
        self.app = app
        self.guard = guard

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.guard.over_limit and scope["path"] not in EXEMPT_PATHS:
            await error_response(503, "the server is at its connection limit; try again shortly",
                                 "service_unavailable_error")(scope, receive, send)
            return
        self.guard.in_progress += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.guard.in_progress -= 1


def bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot bind the HTTP API to {host}:{port}: {exc.strerror}") from exc
    sock.set_inheritable(True)
    return sock


def guarded_config(app: Any, guard: ConnectionGuard, **options: Any) -> uvicorn.Config:
    """uvicorn's configuration for `app` behind `guard`, accepting ACCEPTS_PER_LOOP_TURN
    connections per loop turn (GuardedServer deepens the listen queue again)."""
    return uvicorn.Config(app, http=guard.protocol(), backlog=ACCEPTS_PER_LOOP_TURN, **options)


class GuardedServer(uvicorn.Server):
    """uvicorn on a running event loop that someone else owns (its signals included)."""

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        # The frontend's ServiceShell owns SIGTERM/SIGINT (health NOT_SERVING, drain, stop);
        # uvicorn's own handlers would replace its handlers and stop HTTP before the drain.
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        for sock in sockets or []:
            sock.listen(LISTEN_BACKLOG)  # asyncio listened with the per-turn accept count
