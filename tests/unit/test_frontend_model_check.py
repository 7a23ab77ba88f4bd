"""A frontend whose tokenizer belongs to another model than its schedulers' refuses to start:
it would turn text into ids of another vocabulary and serve wrong answers, not errors."""
from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from tests.support.grpc_fakes import FakeChannel, healthy_forever
from vmesh.services.frontend.schedulers import SchedulerPool
from vmesh.services.frontend.server import FrontendServicer
from vmesh.v1 import scheduler_pb2


class Scheduler:
    async def GetSchedulerStats(self, request, **kwargs):
        return scheduler_pb2.GetSchedulerStatsResponse(model_name="SmolLM2-135M-Instruct", max_model_len=100,
                                                       vocab_size=10)


def connect(model_name: str) -> None:
    async def main() -> None:
        f = FrontendServicer(object(), ["s:1"], ["d:1"], model_name=model_name)

        async def no_detokenizer(address: str, opened: Callable[[], None]) -> None:  # no detokenizers here
            opened()
            await asyncio.Event().wait()

        f._subscribe = no_detokenizer
        f.schedulers = SchedulerPool(lambda address: (Scheduler(), FakeChannel()), health_stream=healthy_forever)
        try:
            await f.connect()
        finally:
            await f.close()

    asyncio.run(main())


def test_a_frontend_for_another_model_refuses_to_start():
    with pytest.raises(RuntimeError, match="give both the same --model"):
        connect("Qwen2-0.5B")


def test_a_frontend_for_the_same_model_starts():
    connect("SmolLM2-135M-Instruct")
