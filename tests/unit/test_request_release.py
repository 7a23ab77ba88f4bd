"""Every way a request can end early releases it in the scheduler: a submission whose outcome is
unknown is aborted, a refused one is not; outputs for a key the frontend does not serve abort
their request; a scheduler drops a submission whose deadline has passed; an abort on the
server's side is an error on gRPC, as on HTTP. No network."""
from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from tests.support.eventually import eventually
from tests.support.fake_scheduler import FakeScheduler
from tests.support.frontends import serving_frontend
from tests.support.grpc_fakes import Aborted, FakeContext, rpc_error
from tests.unit.test_scheduler_server import Servicer, connected
from vmesh.services.common.generation import GenerationRequest
from vmesh.services.common.types import FinishReason, OutputBatch, SamplingParams, StreamOutput
from vmesh.services.frontend.errors import RequestError
from vmesh.services.frontend.server import FrontendServicer
from vmesh.v1 import frontend_pb2, scheduler_pb2


class TakesThenFails(FakeScheduler):
    """Queues each submission, then its call fails with `code` (its reply was lost on the way:
    the deadline passed while it travelled, say)."""

    def __init__(self, code: grpc.StatusCode, gate: asyncio.Event | None = None):
        super().__init__()
        self.code = code
        self.gate = gate  # set: the reply is held until the gate opens

    async def SubmitRequest(self, request: Any, **kwargs: Any) -> scheduler_pb2.SubmitRequestResponse:
        await super().SubmitRequest(request, **kwargs)
        if self.gate is not None:
            await self.gate.wait()
        raise rpc_error(self.code)


async def drain(stream) -> list:
    return [x async for x in stream]


REQUEST = GenerationRequest([1, 2, 3], SamplingParams(max_tokens=100))


@pytest.mark.parametrize("code", [grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                                  grpc.StatusCode.UNKNOWN])
def test_a_submission_whose_reply_is_lost_is_aborted(code):
    async def main():
        f, scheduler = await serving_frontend(object(), TakesThenFails(code), failover_timeout_s=0.3)
        with pytest.raises(RequestError):
            await drain(f.generate(REQUEST))
        await eventually(lambda: not f.background)
        # Each try that may have been taken is aborted, and a try after one goes under a new key
        # (the abort on its way must not stop it).
        keys = [s.frontend_key for s in scheduler.submitted]
        assert sorted(scheduler.aborted) == sorted(keys) and len(set(keys)) == len(keys) >= 1
        assert f.schedulers.groups["s:1"].in_flight == 0
        await f.schedulers.close()

    asyncio.run(main())


@pytest.mark.parametrize("code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED])
def test_a_refused_submission_is_not_aborted(code):
    async def main():
        f, scheduler = await serving_frontend(object(), TakesThenFails(code))
        with pytest.raises(RequestError) as refused:
            await drain(f.generate(REQUEST))
        await eventually(lambda: not f.background)
        assert refused.value.code == code and scheduler.aborted == []
        assert f.schedulers.groups["s:1"].in_flight == 0
        await f.schedulers.close()

    asyncio.run(main())


def test_a_client_that_leaves_during_a_submission_that_then_times_out_aborts_it():
    async def main():
        gate = asyncio.Event()
        f, scheduler = await serving_frontend(object(), TakesThenFails(grpc.StatusCode.DEADLINE_EXCEEDED, gate))
        client = asyncio.create_task(drain(f.generate(REQUEST)))
        await scheduler.until_submitted(1)
        client.cancel()
        await asyncio.gather(client, return_exceptions=True)
        gate.set()  # the scheduler's reply: lost
        await eventually(lambda: not f.background)
        assert scheduler.aborted == [scheduler.submitted[0].frontend_key]
        assert f.schedulers.groups["s:1"].in_flight == 0
        await f.schedulers.close()

    asyncio.run(main())


def stream_output(key: int, finish: FinishReason | None = None, error: str = "") -> OutputBatch:
    return OutputBatch([StreamOutput(key, "x", [5], finish, 3, 1, 0, error=error)])


def test_outputs_for_a_key_nobody_serves_abort_it_once():
    async def main():
        f, scheduler = await serving_frontend(object())
        f.dispatch(stream_output(1234))
        f.dispatch(stream_output(1234))  # still on its way: no second abort
        f.dispatch(stream_output(99, FinishReason.LENGTH))  # ended already: nothing to stop
        f.dispatch(stream_output(98, FinishReason.ABORT, error="the worker failed"))
        await eventually(lambda: not f.background)
        assert scheduler.aborted == [1234] and f.schedulers.groups["s:1"].in_flight == 0
        await f.schedulers.close()

    asyncio.run(main())


def test_outputs_still_arriving_for_a_cancelled_request_cost_no_second_abort():
    async def main():
        f, scheduler = await serving_frontend(object())
        client = asyncio.create_task(drain(f.generate(REQUEST)))
        await scheduler.until_submitted(1)
        key = scheduler.submitted[0].frontend_key
        client.cancel()
        await asyncio.gather(client, return_exceptions=True)
        f.dispatch(stream_output(key))
        await eventually(lambda: not f.background)
        assert scheduler.aborted == [key]
        await f.schedulers.close()

    asyncio.run(main())


class PastDeadline(FakeContext):
    def time_remaining(self) -> float | None:
        return -0.001


def test_the_scheduler_drops_a_submission_whose_deadline_has_passed():
    async def main() -> None:
        servicer = Servicer(["127.0.0.1:1"])
        await connected(servicer)
        request = scheduler_pb2.SubmitRequestRequest(frontend_id="f", frontend_key=1, prompt_token_ids=[1, 2, 3])
        with pytest.raises(Aborted) as dropped:
            await servicer.SubmitRequest(request, PastDeadline())
        assert dropped.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert not servicer.session.scheduler.has_unfinished() and not servicer.session.router.routes
        assert await servicer.submit(2)  # in time: taken
        await servicer.session.close()

    asyncio.run(main())


def test_a_server_abort_is_an_error_on_grpc_not_a_final_looking_finish():
    async def main():
        f, scheduler = await serving_frontend(object())
        call = asyncio.create_task(drain(FrontendServicer(f).Generate(
            frontend_pb2.GenerateRequest(token_ids=frontend_pb2.TokenIds(ids=[1, 2, 3])), FakeContext())))
        await scheduler.until_submitted(1)
        key = scheduler.submitted[0].frontend_key
        f.dispatch(stream_output(key))
        f.dispatch(stream_output(key, FinishReason.ABORT))
        with pytest.raises(Aborted) as failed:
            await call
        await f.schedulers.close()
        return failed.value

    failed = asyncio.run(main())
    assert failed.code == grpc.StatusCode.UNAVAILABLE and "aborted" in str(failed)
