"""A scheduler group's stub as the frontend sees it (SchedulerPool's `connect`), without a network."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from tests.support.grpc_fakes import rpc_error
from vmesh.services.common.types import ModelLimits
from vmesh.v1 import scheduler_pb2

SERVED = ModelLimits("m", 1000, 1000)


class FakeScheduler:
    """Serves `limits`' model; takes every submission (unless `refuse`: then it answers
    UNAVAILABLE, a group that cannot take requests now), recording a copy of each and the aborts.
    `detokenizer(n)`: the replica it names for its n-th submission."""

    def __init__(self, limits: ModelLimits = SERVED,
                 detokenizer: Callable[[int], str] = lambda n: "d:1"):
        self.limits = limits
        self.detokenizer = detokenizer
        self.submitted: list[scheduler_pb2.SubmitRequestRequest] = []
        self.aborted: list[int] = []
        self.refuse = False
        self.arrived = asyncio.Event()

    async def GetSchedulerStats(self, request: Any, **kwargs: Any) -> scheduler_pb2.GetSchedulerStatsResponse:
        return scheduler_pb2.GetSchedulerStatsResponse(model_name=self.limits.name,
                                                       max_model_len=self.limits.max_model_len,
                                                       vocab_size=self.limits.vocab_size)

    async def SubmitRequest(self, request: Any, **kwargs: Any) -> scheduler_pb2.SubmitRequestResponse:
        if self.refuse:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE)
        copy = scheduler_pb2.SubmitRequestRequest()
        copy.CopyFrom(request)  # a failover changes the frontend's message and resubmits it
        self.submitted.append(copy)
        self.arrived.set()
        return scheduler_pb2.SubmitRequestResponse(detokenizer=self.detokenizer(len(self.submitted)))

    async def WatchCache(self, request: Any, **kwargs: Any) -> AsyncIterator[scheduler_pb2.CacheUpdate]:
        """No cache stream (as a scheduler that predates it): frontends route by their own tables."""
        raise rpc_error(grpc.StatusCode.UNIMPLEMENTED)
        yield  # pragma: no cover - a stream

    async def AbortRequest(self, request: Any, **kwargs: Any) -> scheduler_pb2.AbortRequestResponse:
        self.aborted.append(request.frontend_key)
        return scheduler_pb2.AbortRequestResponse()

    async def until_submitted(self, count: int) -> None:
        # An event, not a bounded spin: tokenizing runs on a worker thread.
        while len(self.submitted) < count:
            self.arrived.clear()
            await self.arrived.wait()
