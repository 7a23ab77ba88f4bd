"""The scheduler groups a frontend submits to. Data parallelism is one scheduler per worker
group; a frontend spreads its requests over the groups, fewest of its own requests in flight
first, and sends each abort to the group that holds the request."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_server import channel
from services.frontend.validation import ModelLimits
from vmesh.v1 import scheduler_pb2, scheduler_pb2_grpc

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 600.0  # a group's worker may still be loading its model
JOIN_RETRY_S = 5.0
WATCH_RETRY_S = 0.5


@dataclass
class SchedulerGroup:
    address: str
    stub: scheduler_pb2_grpc.SchedulerServiceStub
    channel: grpc.aio.Channel
    in_flight: int = 0
    ready: bool = False  # it answered, serving the same model as the others
    retired: bool = False  # its address left the list: no new requests; closed once idle
    joined: asyncio.Event = field(default_factory=asyncio.Event)  # set once it answered (or was retired)


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
                 health_stream: Callable[[SchedulerGroup], AsyncIterator[Any]] = health_stream):
        """`on_lost(group)`: the group's scheduler went away (its process died or restarted); what
        it held is gone, including requests still queued there that no detokenizer knows of."""
        self._connect = connect
        self._on_lost = on_lost
        self._health_stream = health_stream
        self.groups: dict[str, SchedulerGroup] = {}
        self.limits: ModelLimits | None = None
        self._tasks: set[asyncio.Task] = set()

    def add(self, address: str) -> SchedulerGroup:
        if (group := self.groups.get(address)) is not None:  # left and came back before it was idle
            group.retired = False
            return group
        group = self.groups[address] = SchedulerGroup(address, *self._connect(address))
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
        process goes, which is how requests that never produced a token learn of it."""
        while not group.retired:
            try:
                async for _ in self._health_stream(group):
                    pass
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.CANCELLED and group.retired:
                    return
                logger.error("scheduler %s lost (%s)", group.address, exc.code().name)
            else:
                logger.error("scheduler %s ended its health stream", group.address)
            self._on_lost(group)
            await asyncio.sleep(WATCH_RETRY_S)

    def _spawn(self, work) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def remove(self, address: str) -> None:
        if (group := self.groups.get(address)) is not None:
            group.retired = True
            group.joined.set()
            self._close_if_idle(group)

    def candidates(self) -> list[SchedulerGroup]:
        """Groups that take new requests, the least busy first."""
        return sorted((g for g in self.groups.values() if g.ready and not g.retired), key=lambda g: g.in_flight)

    def acquire(self, group: SchedulerGroup) -> None:
        group.in_flight += 1

    def release(self, group: SchedulerGroup) -> None:
        group.in_flight -= 1
        self._close_if_idle(group)

    def _close_if_idle(self, group: SchedulerGroup) -> None:
        if group.retired and group.in_flight == 0 and self.groups.get(group.address) is group:
            del self.groups[group.address]
            self._spawn(group.channel.close())
            logger.info("scheduler %s left", group.address)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for group in list(self.groups.values()):  # a group may leave while another closes
            await group.channel.close()
