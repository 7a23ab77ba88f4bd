"""The scheduler groups a frontend submits to. Data parallelism is one scheduler per worker
group; a frontend sends each request to the group most likely to hold its prompt's prefix in
cache (prefix_routing.py), or with `--routing least-busy` to the one with the fewest of its own
requests in flight, and sends each abort to the group that holds the request."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from vmesh.services.common.grpc_server import channel
from vmesh.services.common.replica_set import ReplicaSet
from vmesh.services.common.types import ModelLimits
from vmesh.services.frontend.prefix_routing import PrefixRouter
from vmesh.v1 import scheduler_pb2, scheduler_pb2_grpc

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 600.0  # a group's worker may still be loading its model
JOIN_RETRY_S = 5.0
LOSS_GRACE_S = 3.0  # a broken connection to a live scheduler is normally back well within this
WATCH_RETRY_S = 0.5
ROUTING_POLICIES = ("prefix", "least-busy")
SERVING = health_pb2.HealthCheckResponse.SERVING


@dataclass
class SchedulerGroup:
    address: str
    stub: scheduler_pb2_grpc.SchedulerServiceStub
    channel: grpc.aio.Channel
    in_flight: int = 0
    ready: bool = False  # it answered, serving the same model as the others
    retired: bool = False  # its address left the list: no new requests; closed once idle
    joined: asyncio.Event = field(default_factory=asyncio.Event)  # set once it answered (or was retired)
    incarnation: str = ""  # the scheduler process's id: a different one is a restarted scheduler


def health_stream(group: SchedulerGroup) -> AsyncIterator[health_pb2.HealthCheckResponse]:
    """The scheduler's health updates, for as long as its process lives."""
    return health_pb2_grpc.HealthStub(group.channel).Watch(health_pb2.HealthCheckRequest(service=""),
                                                           wait_for_ready=True)


def connect(address: str) -> tuple[scheduler_pb2_grpc.SchedulerServiceStub, grpc.aio.Channel]:
    ch = channel(address, "scheduler")
    return scheduler_pb2_grpc.SchedulerServiceStub(ch), ch


class SchedulerPool:
    def __init__(self, connect: Callable[[str], tuple[scheduler_pb2_grpc.SchedulerServiceStub,
                                                      grpc.aio.Channel]] = connect,
                 on_lost: Callable[[SchedulerGroup], None] = lambda group: None,
                 health_stream: Callable[[SchedulerGroup], AsyncIterator[Any]] = health_stream,
                 loss_grace_s: float = LOSS_GRACE_S, routing: str = "prefix"):
        """`on_lost(group)`: the group's scheduler went away (its process died or restarted); what
        it held is gone, including requests still queued there that no detokenizer knows of.
        `loss_grace_s`: how long a broken connection may take to reach the same process again
        before its requests are given up. `routing`: "prefix" (prefix-aware, load as tie-breaker)
        or "least-busy"."""
        if routing not in ROUTING_POLICIES:
            raise ValueError(f"unknown routing {routing!r} ({' or '.join(ROUTING_POLICIES)})")
        self.prefix_router = PrefixRouter() if routing == "prefix" else None
        self._connect = connect
        self._on_lost = on_lost
        self._health_stream = health_stream
        self.loss_grace_s = loss_grace_s
        # A group that leaves keeps its connection until its last request ends (an abort may still be sent).
        self.members: ReplicaSet[SchedulerGroup] = ReplicaSet(
            "scheduler", self._start, is_idle=lambda group: group.in_flight == 0,
            stop=self._stop,
            on_retire=lambda group: group.joined.set())  # start-up stops waiting for it
        self.limits: ModelLimits | None = None
        self._tasks: set[asyncio.Task] = set()

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
        self._spawn(group.channel.close())

    def _start(self, address: str) -> SchedulerGroup:
        group = SchedulerGroup(address, *self._connect(address))
        self._spawn(self._join(group))
        return group

    async def _join(self, group: SchedulerGroup) -> None:
        while True:
            try:
                stats = await group.stub.GetSchedulerStats(scheduler_pb2.GetSchedulerStatsRequest(),
                                                           wait_for_ready=True, timeout=JOIN_TIMEOUT_S)
                break
            except grpc.aio.AioRpcError as exc:  # start-up stops waiting for it; asking goes on while it is listed
                logger.warning("scheduler %s did not answer (%s); asking again", group.address, exc.details())
                group.joined.set()
                if group.retired:
                    return
                await asyncio.sleep(JOIN_RETRY_S)
        group.incarnation = stats.incarnation
        limits = ModelLimits(stats.model_name, stats.max_model_len, stats.vocab_size)
        if self.limits is None:
            self.limits = limits
        if limits != self.limits:  # a request valid for one group must be valid for all
            logger.error("scheduler %s serves %s, the others %s; not using it", group.address, limits, self.limits)
        else:
            group.ready = True
            self._spawn(self._watch(group))
        group.joined.set()

    async def _watch(self, group: SchedulerGroup) -> None:
        """Hold a health Watch stream open to the group's scheduler: it breaks the moment the
        process goes, which is how requests that never produced a token learn of it. A break
        is only a connection's until proven otherwise: if the same process (same incarnation)
        answers within the grace period, nothing was lost."""
        while not group.retired:
            try:
                async for reply in self._health_stream(group):
                    # NOT_SERVING: recovering a lost worker, or draining; new requests go elsewhere.
                    group.ready = getattr(reply, "status", SERVING) == SERVING
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.CANCELLED and group.retired:
                    return
                reason = exc.code().name
            else:
                reason = "health stream ended"
            group.ready = False  # new requests go elsewhere until it is sorted out
            stats = await self._stats(group, self.loss_grace_s)
            if stats is not None and stats.incarnation == group.incarnation:
                logger.warning("scheduler %s: connection broke (%s), same process reached again", group.address,
                               reason)
                group.ready = True
                continue
            logger.error("scheduler %s lost (%s); its requests fail over", group.address, reason)
            if self.prefix_router is not None:  # a restarted scheduler starts with an empty cache
                self.prefix_router.forget(group.address)
            self._on_lost(group)
            while stats is None and not group.retired:  # until a new process answers
                await asyncio.sleep(WATCH_RETRY_S)
                stats = await self._stats(group, JOIN_RETRY_S)
            if stats is not None:
                group.incarnation = stats.incarnation
                group.ready = True

    async def _stats(self, group: SchedulerGroup, timeout: float) -> scheduler_pb2.GetSchedulerStatsResponse | None:
        try:
            return await group.stub.GetSchedulerStats(scheduler_pb2.GetSchedulerStatsRequest(), wait_for_ready=True,
                                                      timeout=timeout)
        except grpc.aio.AioRpcError:
            return None

    def _spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def candidates(self, prefix_hashes: Sequence[int] = ()) -> list[SchedulerGroup]:
        """Groups that take new requests, in the order to try them: the least busy first, or,
        routing by prefix, the one most likely to hold the prompt's prefix (`prefix_hashes`,
        from prefix_routing.prefix_hashes) first unless it is overloaded."""
        by_load = sorted((g for g in self.members.active() if g.ready), key=lambda g: g.in_flight)
        if self.prefix_router is None:
            return by_load
        return self.prefix_router.order(by_load, prefix_hashes)

    def routed(self, group: SchedulerGroup, prefix_hashes: Sequence[int]) -> None:
        """`group` took a prompt with these prefix hashes."""
        if self.prefix_router is not None:
            self.prefix_router.routed(group.address, prefix_hashes)

    def acquire(self, group: SchedulerGroup) -> None:
        group.in_flight += 1

    def release(self, group: SchedulerGroup) -> None:
        group.in_flight -= 1
        self.members.release_if_idle(group)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for group in self.members:  # a copy: a group may leave while another closes
            await group.channel.close()
