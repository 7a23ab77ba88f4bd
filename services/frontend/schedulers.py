"""The scheduler groups a frontend submits to. Data parallelism is one scheduler per worker
group; a frontend sends each request to the group that holds the longest prefix of its prompt
within a bounded load, as every group's cache stream reports it (prefix_routing.py), or with
`--routing least-busy` to the one with the fewest of its own requests in flight, and sends each
abort to the group that holds the request."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from vmesh.services.common import tls
from vmesh.services.common.cache_events import CacheView
from vmesh.services.common.generation import Submission
from vmesh.services.common.grpc_server import channel
from vmesh.services.common.resume import ResumePoint
from vmesh.services.common.runtime.peers import Peer, PeerSet
from vmesh.services.common.runtime.retry import Backoff
from vmesh.services.common.runtime.stream import KeptStream
from vmesh.services.common.runtime.tasks import TaskGroup
from vmesh.services.common.types import ModelLimits
from vmesh.services.common.wire.cache import cache_update_from_proto
from vmesh.services.common.wire.submission import abort_to_proto, submission_to_proto, take_over_to_proto
from vmesh.services.frontend.prefix_routing import PrefixRouter, PromptRoute, order_by_cache
from vmesh.services.frontend.settings import DEFAULT_ROUTING, ROUTING_POLICIES
from vmesh.v1 import scheduler_pb2, scheduler_pb2_grpc

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 600.0  # a group's worker may still be loading its model
JOIN_RETRY = Backoff(5.0)
REACH_TIMEOUT_S = 5.0  # one attempt to reach a lost group's new process
LOSS_GRACE_S = 3.0  # a broken connection to a live scheduler is normally back well within this
WATCH_RETRY = Backoff(0.5)  # between attempts to reach a lost group's new process
CACHE_RETRY = Backoff(1.0)  # between attempts to open a group's cache stream again
SERVING = health_pb2.HealthCheckResponse.SERVING


@dataclass
class SchedulerGroup(Peer):
    """One scheduler group. `alive`: it answered, serving the same model as the others, and its
    process has not been lost since; `draining`: its health says NOT_SERVING; `joined`: set once
    it answered (or was retired); `in_flight`: this frontend's requests there."""
    stub: scheduler_pb2_grpc.SchedulerServiceStub = field(kw_only=True)
    channel: grpc.aio.Channel = field(kw_only=True)
    incarnation: str = ""  # the scheduler process's id: a different one is a restarted scheduler
    cache: CacheView | None = None  # its prefix cache and load, while its cache stream is up

    async def submit(self, submission: Submission, timeout: float) -> str:
        """Hand the request to the group; returns the detokenizer replica its scheduler chose."""
        reply = await self.stub.SubmitRequest(submission_to_proto(submission), timeout=timeout)
        return reply.detokenizer

    async def abort(self, frontend_id: str, frontend_key: int, timeout: float) -> None:
        await self.stub.AbortRequest(abort_to_proto(frontend_id, frontend_key), timeout=timeout)

    async def take_over(self, resume: ResumePoint, prompt_digest: bytes, timeout: float) -> list[int]:
        """The first outputs of the request resumed under `resume.key` (which stops here)."""
        reply = await self.stub.TakeOverRequest(take_over_to_proto(resume, prompt_digest), timeout=timeout)
        return list(reply.output_token_ids)


def health_stream(group: SchedulerGroup) -> AsyncIterator[health_pb2.HealthCheckResponse]:
    """The scheduler's health updates, for as long as its process lives."""
    return health_pb2_grpc.HealthStub(group.channel).Watch(health_pb2.HealthCheckRequest(service=""),
                                                           wait_for_ready=True)


def connect(address: str, identity: tls.Identity | None = None,
            ) -> tuple[scheduler_pb2_grpc.SchedulerServiceStub, grpc.aio.Channel]:
    """`identity`: this frontend's, when the mesh uses mutual TLS."""
    ch = channel(address, "scheduler", identity=identity)
    return scheduler_pb2_grpc.SchedulerServiceStub(ch), ch


class SchedulerPool:
    def __init__(self, connect: Callable[[str], tuple[scheduler_pb2_grpc.SchedulerServiceStub,
                                                      grpc.aio.Channel]] = connect,
                 on_lost: Callable[[SchedulerGroup], None] = lambda group: None,
                 health_stream: Callable[[SchedulerGroup], AsyncIterator[Any]] = health_stream,
                 loss_grace_s: float = LOSS_GRACE_S, routing: str = DEFAULT_ROUTING,
                 join_retry: Backoff = JOIN_RETRY, watch_retry: Backoff = WATCH_RETRY,
                 cache_retry: Backoff = CACHE_RETRY):
        """`on_lost(group)`: the group's scheduler went away (its process died or restarted); what
        it held is gone, including requests still queued there that no detokenizer knows of.
        `loss_grace_s`: how long a broken connection may take to reach the same process again
        before its requests are given up. `routing`: "prefix" (prefix-aware on the groups' cache
        streams, load as tie-breaker), "prefix-table" (the same on this frontend's own table) or
        "least-busy". `join_retry`: the wait before asking a group that did not answer again;
        `watch_retry`: before trying again to reach a lost group's new process; `cache_retry`: before
        opening a group's broken cache stream again."""
        if routing not in ROUTING_POLICIES:
            raise ValueError(f"unknown routing {routing!r} ({' or '.join(ROUTING_POLICIES)})")
        self.prefix_router = PrefixRouter() if routing in ("prefix", "prefix-table") else None
        self.follows_cache_streams = routing == "prefix"
        self._connect = connect
        self._on_lost = on_lost
        self._health_stream = health_stream
        self.loss_grace_s = loss_grace_s
        self.join_retry = join_retry
        self.watch_retry = watch_retry
        self.cache_retry = cache_retry
        # A group that leaves keeps its connection until its last request ends (an abort may still be sent).
        self.members: PeerSet[SchedulerGroup] = PeerSet(
            "scheduler", self._start, is_idle=lambda group: group.in_flight == 0,
            stop=self._stop,
            on_retire=lambda group: group.joined.set())  # start-up stops waiting for it
        self.limits: ModelLimits | None = None
        self._tasks = TaskGroup()

    @property
    def groups(self) -> dict[str, SchedulerGroup]:
        return self.members.members

    def add(self, address: str) -> SchedulerGroup:
        return self.members.add(address)

    def remove(self, address: str) -> None:
        self.members.remove(address)

    def _stop(self, group: SchedulerGroup) -> None:
        if self.prefix_router is not None:
            self.prefix_router.forget(group.address)
        group.stop()
        self._tasks.spawn(group.channel.close())

    def _start(self, address: str) -> SchedulerGroup:
        stub, ch = self._connect(address)
        group = SchedulerGroup(address, stub=stub, channel=ch)
        group.task = asyncio.create_task(self._keep(group))
        return group

    async def _keep(self, group: SchedulerGroup) -> None:
        """Join the group, then hold a health Watch stream open to its scheduler: it breaks the
        moment the process goes, which is how requests that never produced a token learn of it."""
        if await self._join(group):
            follow = asyncio.create_task(self._follow_cache(group)) if self.follows_cache_streams else None
            try:
                await KeptStream(group, lambda opened: self._watch(group), lambda exc: self._lost(group, exc),
                                 Backoff.none()).run()  # _lost waits as long as reaching the scheduler again takes
            finally:
                if follow is not None:
                    follow.cancel()

    async def _follow_cache(self, group: SchedulerGroup) -> None:
        """Keep the group's cache view from its stream; without a stream (it broke, or the
        scheduler predates it) the group has none, and routing falls back to this frontend's table."""
        failures = 0
        while True:
            try:
                async for message in group.stub.WatchCache(scheduler_pb2.WatchCacheRequest(), wait_for_ready=True):
                    update = cache_update_from_proto(message)
                    if group.cache is None or update.snapshot:
                        group.cache = CacheView(update)
                        failures = 0
                    else:
                        group.cache.apply(update)
                raise ConnectionError("the cache stream ended")
            except (grpc.aio.AioRpcError, ConnectionError) as exc:
                group.cache = None
                code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else None
                if code in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.PERMISSION_DENIED):
                    logger.warning("scheduler %s has no cache stream for this frontend (%s): routing by this "
                                   "frontend's own table", group.address, code.name)
                    return
                failures += 1
                await self.cache_retry.sleep(failures)

    async def _join(self, group: SchedulerGroup) -> bool:
        """Ask the group for its model until it answers; whether it serves this pool's model."""
        failures = 0
        while True:
            try:
                stats = await group.stub.GetSchedulerStats(scheduler_pb2.GetSchedulerStatsRequest(),
                                                                wait_for_ready=True, timeout=JOIN_TIMEOUT_S)
                break
            except grpc.aio.AioRpcError as exc:  # start-up stops waiting for it; asking goes on while it is listed
                logger.warning("scheduler %s did not answer (%s); asking again", group.address, exc.details())
                group.joined.set()
                if group.retired:
                    return False
                failures += 1
                await self.join_retry.sleep(failures)
        group.incarnation = stats.incarnation
        limits = ModelLimits(stats.model_name, stats.max_model_len, stats.vocab_size)
        if self.limits is None:
            self.limits = limits
        serves_the_model = limits == self.limits  # a request valid for one group must be valid for all
        if serves_the_model:
            group.alive = True
        else:
            logger.error("scheduler %s serves %s, the others %s; not using it", group.address, limits, self.limits)
        group.joined.set()
        return serves_the_model

    async def _watch(self, group: SchedulerGroup) -> None:
        async for reply in self._health_stream(group):
            # NOT_SERVING: recovering a lost worker, or draining; new requests go elsewhere.
            group.draining = getattr(reply, "status", SERVING) != SERVING
        raise ConnectionError("health stream ended")

    async def _lost(self, group: SchedulerGroup, exc: Exception) -> bool:
        """The health stream broke. A break is only a connection's until proven otherwise: if the
        same process (same incarnation) answers within the grace period, nothing was lost.
        Returns whether to watch again (not once the group left)."""
        if isinstance(exc, grpc.aio.AioRpcError):
            if exc.code() == grpc.StatusCode.CANCELLED and group.retired:
                return False
            reason = exc.code().name
        elif isinstance(exc, ConnectionError):
            reason = str(exc)
        else:
            raise exc  # not a break: a bug, which must not pass for a lost scheduler
        group.alive = False  # new requests go elsewhere until it is sorted out
        stats = await self._stats(group, self.loss_grace_s)
        if stats is not None and stats.incarnation == group.incarnation:
            logger.warning("scheduler %s: connection broke (%s), same process reached again", group.address, reason)
        else:
            if group.draining and group.in_flight == 0:  # most often a drained group stopping: a scale-down
                logger.warning("scheduler %s went away while not serving (%s: draining, or recovering its worker), "
                               "holding none of this frontend's requests", group.address, reason)
            else:
                logger.error("scheduler %s lost (%s); its requests fail over", group.address, reason)
            if self.prefix_router is not None:  # a restarted scheduler starts with an empty cache
                self.prefix_router.forget(group.address)
            self._on_lost(group)
            failures = 0
            while stats is None and not group.retired:  # until a new process answers
                failures += 1
                await self.watch_retry.sleep(failures)
                stats = await self._stats(group, REACH_TIMEOUT_S)
            if stats is None:
                return False
            group.incarnation = stats.incarnation
        group.alive, group.draining = True, False
        return not group.retired

    async def _stats(self, group: SchedulerGroup, timeout: float) -> scheduler_pb2.GetSchedulerStatsResponse | None:
        try:
            return await group.stub.GetSchedulerStats(scheduler_pb2.GetSchedulerStatsRequest(),
                                                           wait_for_ready=True, timeout=timeout)
        except grpc.aio.AioRpcError:
            return None

    def candidates(self, route: PromptRoute | None = None) -> list[SchedulerGroup]:
        """Groups that take new requests, in the order to try them: the least busy first, or,
        routing by prefix, the one that holds the longest prefix of `route` within the load bound
        first (exactly while every group's cache stream is up, else by this frontend's table)."""
        by_load = sorted((g for g in self.members.active() if g.ready), key=lambda g: g.in_flight)
        if self.prefix_router is None or route is None:
            return by_load
        if by_load and all(g.cache is not None for g in by_load):
            return order_by_cache(by_load, route)
        return self.prefix_router.order(by_load, route.chunk_hashes)

    def routed(self, group: SchedulerGroup, route: PromptRoute | None) -> None:
        """`group` took a request that will cache `route`."""
        if self.prefix_router is not None and route is not None:
            self.prefix_router.routed(group.address, route.chunk_hashes)
        if group.cache is not None:
            group.cache.sent(route.lora_name if route is not None else "")

    def acquire(self, group: SchedulerGroup) -> None:
        group.in_flight += 1

    def release(self, group: SchedulerGroup) -> None:
        group.in_flight -= 1
        self.members.release_if_idle(group)

    async def close(self) -> None:
        self._tasks.cancel()
        for group in self.members:  # a copy: a group may leave while another closes
            group.stop()
            await group.channel.close()

