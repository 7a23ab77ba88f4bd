"""The scheduler's side of its detokenizer replicas: one Detokenize stream per replica, kept
open and reopened after a loss; which replica serves each request and under which number;
each step's tokens batched per replica and written in order; and what the replicas say back
(draining, stop-string hits, requests whose frontend went away).

A request has one number per link. On this one it is its *stream handle*, numbered here, apart
from the worker handle the scheduler core gives it on the Execute stream."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import grpc

from vmesh.services.common.grpc_server import channel
from vmesh.services.common.runtime.peers import Peer, PeerSet
from vmesh.services.common.runtime.retry import Backoff
from vmesh.services.common.runtime.stream import KeptStream
from vmesh.services.common.tls import Identity
from vmesh.services.common.types import FinishReason, StepTokens, StreamStart, TokenBatch
from vmesh.services.common.wire import tokens
from vmesh.services.scheduler.scheduler import RequestUpdate
from vmesh.v1 import detokenizer_pb2_grpc

logger = logging.getLogger(__name__)

RECONNECT = Backoff(1.0)

OpenStream = Callable[[str], tuple[grpc.aio.StreamStreamCall, grpc.aio.Channel]]


def open_stream(address: str, identity: Identity | None = None) -> tuple[grpc.aio.StreamStreamCall, grpc.aio.Channel]:
    """`identity`: the scheduler's, with mutual TLS."""
    ch = channel(address, "detokenizer", identity=identity)
    return detokenizer_pb2_grpc.DetokenizerServiceStub(ch).Detokenize(wait_for_ready=True), ch


@dataclass
class Replica(Peer):
    """One detokenizer replica and the stream to it. A lost stream is reopened (the replica may
    have restarted); a replica whose address leaves the list takes no new requests and is closed
    once its last request ends. `alive`: the stream is open; `draining`: the replica said it is
    shutting down; `in_flight`: requests routed here."""
    call: grpc.aio.StreamStreamCall | None = None
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    pending: TokenBatch = field(default_factory=TokenBatch)
    # A gRPC stream takes one write at a time (a second one in flight fails the call with TOO_MANY_OPERATIONS),
    # and abort RPCs flush concurrently with the engine loop. The lock's FIFO wake-up keeps batches in order.
    write_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def outstanding(self) -> int:
        """Requests routed here and not yet released: the peer's `in_flight`, by the name the
        scheduler's least-outstanding choice of a replica uses."""
        return self.in_flight

    @property
    def has_pending(self) -> bool:
        return bool(self.pending)


@dataclass
class Route:
    """Where one request's outputs go."""
    stream_handle: int  # the request's number on its replica's stream
    replica: Replica
    introduction: StreamStart  # sent once, ahead of its first tokens
    introduced: bool = False


class DetokenizerRouter:
    def __init__(self, on_released: Callable[[str, FinishReason], None], open_stream: OpenStream = open_stream,
                 reconnect: Backoff = RECONNECT):
        """`on_released(request_key, reason)`: the router let a request go on a replica's word (a
        stop string matched: STOP; its frontend went away: ABORT) or because its replica was lost
        (ABORT); the caller stops computing it. Requests are named by the scheduler's request key.
        `reconnect`: the wait before reopening a lost stream."""
        self._on_released = on_released
        self._open_stream = open_stream
        self.reconnect = reconnect
        self.replicas: PeerSet[Replica] = PeerSet(
            "detokenizer", self._start, is_idle=lambda r: r.in_flight == 0 and not r.has_pending,
            stop=Replica.stop, on_retire=lambda r: r.joined.set())  # start-up stops waiting for it
        self.routes: dict[str, Route] = {}
        self.request_key_of: dict[int, str] = {}  # by stream handle
        self._stream_handles = itertools.count()

    async def connect(self, addresses: list[str]) -> None:
        """Open a stream to each replica; returns once each is open (or has left the list)."""
        for address in addresses:
            self.replicas.add(address)
        await asyncio.gather(*(r.joined.wait() for r in self.replicas))

    def close(self) -> None:
        for replica in self.replicas:
            replica.stop()

    # --- routes ------------------------------------------------------------------------------

    def routable(self, allowed: Collection[str] = ()) -> list[Replica]:
        """Replicas that take new requests; `allowed`, when given, limits them to those addresses."""
        return [r for r in self.replicas if r.routable and (not allowed or r.address in allowed)]

    def open_route(self, request_key: str, replica: Replica, introduction: StreamStart) -> Route:
        """Route a request to `replica`; `introduction` lacks only the stream handle, set here."""
        route = Route(next(self._stream_handles), replica, introduction)
        introduction.handle = route.stream_handle
        replica.in_flight += 1
        self.routes[request_key] = route
        self.request_key_of[route.stream_handle] = request_key
        return route

    def close_route(self, request_key: str) -> Route | None:
        """Forget a request's route (it finished, or is being aborted); None if it had none."""
        route = self.routes.pop(request_key, None)
        if route is not None:
            del self.request_key_of[route.stream_handle]
            route.replica.in_flight -= 1
        return route

    def add_update(self, route: Route, update: RequestUpdate) -> None:
        """Queue a step's update (tokens, logprobs, finish) for the route's replica."""
        self._introduce(route)
        route.replica.pending.requests.append(StepTokens(
            route.stream_handle, update.new_token_ids, update.finish_reason, update.num_cached_prompt_tokens,
            update.logprobs, update.error, update.prompt_logprobs, update.embedding))

    def add_end(self, route: Route, error: str = "") -> None:
        """Tell a closed route's replica that its request ended without more tokens (aborted or failed)."""
        self._introduce(route)
        route.replica.pending.requests.append(StepTokens(route.stream_handle, [], FinishReason.ABORT, error=error))

    def _introduce(self, route: Route) -> None:
        if not route.introduced:
            route.replica.pending.new_requests.append(route.introduction)
            route.introduced = True

    async def flush(self) -> None:
        """Write each replica's pending batch."""
        for replica in self.replicas:
            if replica.has_pending:
                batch, replica.pending = replica.pending, TokenBatch()
                async with replica.write_lock:
                    if replica.alive and replica.call is not None:
                        try:
                            await replica.call.write(tokens.to_proto(batch))
                        except Exception as exc:
                            self._lost(replica, exc)
            self.replicas.release_if_idle(replica)  # a retired replica goes once its last outputs are out

    # --- replica streams ---------------------------------------------------------------------

    def _start(self, address: str) -> Replica:
        replica = Replica(address)

        async def lost(exc: Exception) -> bool:
            self._lost(replica, exc)
            return True  # reopened until the replica is let go

        stream = KeptStream(replica, lambda opened: self._keep(replica, opened), lost, self.reconnect)
        replica.task = asyncio.create_task(stream.run())
        return replica

    async def _keep(self, replica: Replica, opened: Callable[[], None]) -> None:
        """One stream to the replica, held until it is lost (on a read or a write)."""
        call, ch = self._open_stream(replica.address)
        reader = None
        try:
            await call.wait_for_connection()  # the replica sends initial metadata on a new stream
            replica.lost.clear()
            async with replica.write_lock:  # not while a write to the previous stream is in flight
                replica.call = call
                replica.draining = False  # a restarted replica; one still draining says so again at once
                opened()
            logger.info("detokenizer %s connected", replica.address)
            reader = asyncio.create_task(self._read(replica, call))
            await replica.lost.wait()
        finally:
            if reader is not None:
                reader.cancel()
            call.cancel()
            await ch.close()

    async def _read(self, replica: Replica, call: grpc.aio.StreamStreamCall) -> None:
        try:
            while True:
                response = await call.read()
                if response is grpc.aio.EOF:
                    raise ConnectionError("stream closed")
                if response.draining and not replica.draining:
                    replica.draining = True
                    logger.info("detokenizer %s is draining; routing no new requests to it", replica.address)
                # A stop string matched, or the owning frontend went away: either way the
                # detokenizer has already let the request go.
                for stream_handles, reason in ((response.stopped_handles, FinishReason.STOP),
                                               (response.orphaned_handles, FinishReason.ABORT)):
                    for stream_handle in stream_handles:
                        if (request_key := self.request_key_of.get(stream_handle)) is not None:
                            self.close_route(request_key)
                            self._on_released(request_key, reason)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._lost(replica, exc)

    def _lost(self, replica: Replica, exc: Exception) -> None:
        """Release the replica's requests; the replica tells their frontends (or their
        subscriptions break, when the replica itself is gone). Its KeptStream reconnects."""
        replica.lost.set()
        if not replica.alive:
            return
        replica.alive = False
        replica.pending = TokenBatch()  # nothing in it can reach anyone now
        lost = [key for key, route in self.routes.items() if route.replica is replica]
        logger.error("detokenizer %s lost (%s); aborting its %d request(s)", replica.address, exc, len(lost))
        for request_key in lost:
            self.close_route(request_key)
            self._on_released(request_key, FinishReason.ABORT)
        self.replicas.release_if_idle(replica)
