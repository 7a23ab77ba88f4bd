"""The scheduler groups a frontend submits to. Data parallelism is one scheduler per worker
group; a frontend spreads its requests over the groups, fewest of its own requests in flight
first, and sends each abort to the group that holds the request."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from services.common.grpc_server import channel
from services.frontend.validation import ModelLimits
from vmesh.v1 import scheduler_pb2, scheduler_pb2_grpc

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 600.0  # a group's worker may still be loading its model
JOIN_RETRY_S = 5.0


@dataclass
class SchedulerGroup:
    address: str
    stub: scheduler_pb2_grpc.SchedulerServiceStub
    channel: grpc.aio.Channel
    in_flight: int = 0
    ready: bool = False  # it answered, serving the same model as the others
    retired: bool = False  # its address left the list: no new requests; closed once idle
    joined: asyncio.Event = field(default_factory=asyncio.Event)  # set once it answered (or was retired)


def connect(address: str) -> tuple[scheduler_pb2_grpc.SchedulerServiceStub, grpc.aio.Channel]:
    ch = channel(address)
    return scheduler_pb2_grpc.SchedulerServiceStub(ch), ch


class SchedulerPool:
    def __init__(self, connect: Callable[[str], tuple[scheduler_pb2_grpc.SchedulerServiceStub,
                                                      grpc.aio.Channel]] = connect):
        self._connect = connect
        self.groups: dict[str, SchedulerGroup] = {}
        self.limits: ModelLimits | None = None
        self._tasks: set[asyncio.Task] = set()

    def add(self, address: str) -> SchedulerGroup:
        if (group := self.groups.get(address)) is not None:  # left and came back before it was idle
            group.retired = False
            return group
        group = self.groups[address] = SchedulerGroup(address, *self._connect(address))
        task = asyncio.create_task(self._join(group))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
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
        group.joined.set()

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
            task = asyncio.create_task(group.channel.close())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            logger.info("scheduler %s left", group.address)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for group in self.groups.values():
            await group.channel.close()
