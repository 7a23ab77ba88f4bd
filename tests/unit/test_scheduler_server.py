"""The scheduler service over its DetokenizerRouter: where submissions go, what a replica's word or loss
does to the scheduler's queues, and refused submissions; driven without a network."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import pytest

from tests.support.eventually import eventually
from tests.support.grpc_fakes import Aborted, FakeChannel, FakeContext, FakeStream, rpc_error
from vmesh.services.common.admission import MAX_STOP_TOKEN_IDS
from vmesh.services.common.runtime.retry import Backoff
from vmesh.services.common.step_types import StepResult
from vmesh.services.common.wire.step import result_to_proto
from vmesh.services.scheduler.server import SchedulerServicer
from vmesh.services.scheduler.session import SchedulerSession
from vmesh.services.scheduler.settings import SchedulerServiceSettings
from vmesh.services.scheduler.worker_ranks import WORKER_RETRY
from vmesh.v1 import common_pb2, detokenizer_pb2, scheduler_pb2, worker_pb2


class FakeExecute(FakeStream):
    """A worker's Execute stream: plans written are kept; results are fed to `responses`."""

    def __init__(self) -> None:
        super().__init__()
        self.plans: list[worker_pb2.ExecuteRequest] = []

    async def write(self, message) -> None:
        self.refuse_if_done()
        self.plans.append(message)


class FakeWorker:
    """A worker rank's stub: UNAVAILABLE while `down` (dead, or loading its model)."""

    def __init__(self) -> None:
        self.down = False
        self.refusals = 0  # GetWorkerInfo calls answered UNAVAILABLE
        self.streams: list[FakeExecute] = []

    async def GetWorkerInfo(self, request, **kwargs):
        if self.down:
            self.refusals += 1
            raise rpc_error(grpc.StatusCode.UNAVAILABLE)
        return worker_pb2.GetWorkerInfoResponse(model_name="tiny", num_kv_blocks=16, block_size=4,
                                                max_model_len=64, vocab_size=100, max_num_seqs=8,
                                                eos_token_ids=[0])

    def Execute(self):
        self.streams.append(FakeExecute())
        return self.streams[-1]


class Servicer(SchedulerServicer):
    """Over a session whose worker rank is `worker` and whose replica streams are fakes."""

    def __init__(self, addresses: list[str], worker: FakeWorker | None = None, worker_retry: Backoff = WORKER_RETRY,
                 worker_recovery_timeout_s: float = 60.0):
        self.worker = worker or FakeWorker()
        self.streams: dict[str, list[FakeStream]] = {}
        settings = SchedulerServiceSettings(worker_addresses=["worker:1"], detokenizer_addresses=addresses,
                                            worker_recovery_timeout_s=worker_recovery_timeout_s)
        super().__init__(SchedulerSession(settings, open_detokenizer_stream=self._open_stream,
                                          open_worker_rank=lambda address: (self.worker, FakeChannel()),
                                          worker_retry=worker_retry))

    def _open_stream(self, address: str):
        stream = FakeStream()
        self.streams.setdefault(address, []).append(stream)
        return stream, FakeChannel()

    async def submit(self, frontend_key: int, detokenizers: tuple[str, ...] = ()) -> str:
        reply = await self.SubmitRequest(scheduler_pb2.SubmitRequestRequest(
            frontend_id="f", frontend_key=frontend_key, prompt_token_ids=[1, 2, 3],
            detokenizers=detokenizers), FakeContext())
        return reply.detokenizer


async def connected(servicer: Servicer) -> None:
    """The scheduler core built from the worker's answer and the replicas connected, but no engine
    loop: what a submission does to the queues stays there."""
    await servicer.session.connect_workers(timeout=1)
    await servicer.session.router.connect(servicer.session.detokenizers.addresses)


@asynccontextmanager
async def with_worker(worker: FakeWorker, **settings) -> AsyncIterator[Servicer]:
    """A servicer connected to `worker` as serve() connects it, its engine loop running."""
    servicer = Servicer(["127.0.0.1:1"], worker, **settings)
    await servicer.connect()
    try:
        yield servicer
    finally:
        await servicer.session.close()


def test_requests_go_only_to_replicas_the_frontend_listens_to():
    async def main() -> None:
        servicer = Servicer(["127.0.0.1:1", "127.0.0.1:2"])
        await connected(servicer)
        picks = {await servicer.submit(i, ("127.0.0.1:2",)) for i in range(4)}
        assert picks == {"127.0.0.1:2"}
        # unrestricted requests spread by least outstanding: the idle replica catches up first
        assert [await servicer.submit(10 + i) for i in range(4)] == ["127.0.0.1:1"] * 4
        with pytest.raises(Aborted) as err:
            await servicer.submit(20, ("127.0.0.1:9",))
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        await servicer.session.close()

    asyncio.run(main())


def test_a_replica_that_leaves_finishes_its_requests_and_then_closes():
    async def main() -> None:
        servicer = Servicer(["127.0.0.1:1"])
        await connected(servicer)
        assert await servicer.submit(0) == "127.0.0.1:1"
        servicer.session.router.replicas.update(["127.0.0.1:2"], ["127.0.0.1:1"])
        await servicer.session.router.replicas.members["127.0.0.1:2"].joined.wait()
        leaving = servicer.session.router.replicas.members["127.0.0.1:1"]
        assert leaving.retired and leaving.alive  # r0 still streams there
        assert await servicer.submit(1) == "127.0.0.1:2"
        r0 = servicer.session.release("f/0")
        servicer.session.router.add_end(r0)  # its last output is queued for the leaving replica...
        assert "127.0.0.1:1" in servicer.session.router.replicas
        await servicer.session.router.flush()  # ...and written before the replica is let go
        assert servicer.streams["127.0.0.1:1"][0].received == [[r0.stream_handle]]
        assert "127.0.0.1:1" not in servicer.session.router.replicas
        await eventually(leaving.task.done)
        assert leaving.task.done()
        await servicer.session.close()

    asyncio.run(main())


def test_a_lost_stream_fails_its_requests_and_reconnects():
    async def main() -> None:
        servicer = Servicer(["127.0.0.1:1"])
        servicer.session.router.reconnect = Backoff.none()
        await connected(servicer)
        await servicer.submit(0)
        first = servicer.streams["127.0.0.1:1"][0]
        first.responses.put_nowait(ConnectionError("reset by peer"))
        await eventually(lambda: first.cancelled and len(servicer.streams["127.0.0.1:1"]) == 2)
        assert first.cancelled
        assert "f/0" not in servicer.session.router.routes and not servicer.session.scheduler.has_unfinished()
        assert len(servicer.streams["127.0.0.1:1"]) == 2  # reopened
        assert servicer.session.router.replicas.members["127.0.0.1:1"].alive
        assert await servicer.submit(1) == "127.0.0.1:1"
        await servicer.session.close()

    asyncio.run(main())


def test_a_draining_replica_gets_no_new_requests_until_it_restarts():
    async def main() -> None:
        servicer = Servicer(["127.0.0.1:1", "127.0.0.1:2"])
        servicer.session.router.reconnect = Backoff.none()
        await connected(servicer)
        servicer.streams["127.0.0.1:1"][0].responses.put_nowait(detokenizer_pb2.DetokenizeResponse(
            draining=True))
        await eventually(lambda: servicer.session.router.replicas.members["127.0.0.1:1"].draining)
        assert servicer.session.router.replicas.members["127.0.0.1:1"].draining
        assert {await servicer.submit(i) for i in range(3)} == {"127.0.0.1:2"}
        servicer.streams["127.0.0.1:1"][0].responses.put_nowait(ConnectionError("it exited"))  # ...and comes back
        await eventually(lambda: len(servicer.streams["127.0.0.1:1"]) == 2)
        assert len(servicer.streams["127.0.0.1:1"]) == 2
        assert await servicer.submit(3) == "127.0.0.1:1"
        await servicer.session.close()

    asyncio.run(main())


def test_requests_the_detokenizer_reports_orphaned_are_stopped():
    async def main() -> None:
        servicer = Servicer(["127.0.0.1:1"])
        await connected(servicer)
        await servicer.submit(0)
        await servicer.submit(1)
        handle = servicer.session.router.routes["f/0"].stream_handle
        servicer.streams["127.0.0.1:1"][0].responses.put_nowait(detokenizer_pb2.DetokenizeResponse(
            orphaned_handles=[handle, 999]))  # 999: unknown, or already gone
        await eventually(lambda: "f/0" not in servicer.session.router.routes)
        assert "f/0" not in servicer.session.router.routes and "f/1" in servicer.session.router.routes
        assert servicer.session.scheduler.stats().num_waiting == 1
        assert servicer.session.router.replicas.members["127.0.0.1:1"].outstanding == 1
        await servicer.session.close()

    asyncio.run(main())


BAD_SUBMISSIONS = [
    (dict(prompt_token_ids=[]), "prompt"),
    (dict(prompt_token_ids=[1, 100]), "token_ids"),
    (dict(prompt_token_ids=list(range(64))), "prompt"),
    (dict(sampling=common_pb2.SamplingParams(temperature=float("nan"))), "temperature"),
    (dict(sampling=common_pb2.SamplingParams(repetition_penalty=float("inf"))), "repetition_penalty"),
    (dict(sampling=common_pb2.SamplingParams(max_tokens=100)), "max_tokens"),
    (dict(sampling=common_pb2.SamplingParams(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1))), "stop_token_ids"),
    (dict(sampling=common_pb2.SamplingParams(stop_token_ids=[100])), "stop_token_ids"),
]


@pytest.mark.parametrize(("fields", "name"), BAD_SUBMISSIONS, ids=[n for _, n in BAD_SUBMISSIONS])
def test_a_submission_the_worker_cannot_serve_is_refused_alone(fields, name):
    """Whoever calls SubmitRequest, a request outside the model's limits never reaches the worker's
    shared step: it is refused with INVALID_ARGUMENT and nothing is queued."""
    async def main() -> None:
        servicer = Servicer(["127.0.0.1:1"])
        await connected(servicer)
        request = scheduler_pb2.SubmitRequestRequest(frontend_id="f", frontend_key=1,
                                                     prompt_token_ids=[1, 2, 3])
        request.MergeFrom(scheduler_pb2.SubmitRequestRequest(**fields))
        if "prompt_token_ids" in fields:
            request.prompt_token_ids[:] = fields["prompt_token_ids"]
        with pytest.raises(Aborted) as refused:
            await servicer.SubmitRequest(request, FakeContext())
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and name in str(refused.value)
        assert not servicer.session.scheduler.has_unfinished() and not servicer.session.router.routes
        assert await servicer.submit(2)  # the next one is served
        await servicer.session.close()

    asyncio.run(main())


def test_a_resumed_submission_is_checked_and_introduced_with_its_outputs():
    async def main() -> None:
        servicer = Servicer(["127.0.0.1:1"])
        await connected(servicer)
        for resumed, max_tokens in (([5, 100], 8), ([5] * 8, 8)):  # out of the vocabulary; no budget left
            with pytest.raises(Aborted) as refused:
                await servicer.SubmitRequest(scheduler_pb2.SubmitRequestRequest(
                    frontend_id="f", frontend_key=1, prompt_token_ids=[1, 2, 3],
                    sampling=common_pb2.SamplingParams(max_tokens=max_tokens), resumed_output_token_ids=resumed),
                    FakeContext())
            assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "resumed_output_token_ids" in str(refused.value)
        await servicer.SubmitRequest(scheduler_pb2.SubmitRequestRequest(
            frontend_id="f", frontend_key=2, prompt_token_ids=[1, 2, 3], sampling=common_pb2.SamplingParams(
                max_tokens=8), resumed_output_token_ids=[7, 8], resumed_text_length=3), FakeContext())
        request = servicer.session.scheduler.requests["f/2"]
        assert request.output_token_ids == [7, 8] and request.all_token_ids == [1, 2, 3, 7, 8]
        introduction = servicer.session.router.routes["f/2"].introduction
        assert list(introduction.resumed_output_token_ids) == [7, 8] and introduction.resumed_text_length == 3
        assert introduction.num_prompt_tokens == 3
        await servicer.session.close()

    asyncio.run(main())


async def fail_stream(worker: FakeWorker, session: int = 0, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE,
                      details: str = "") -> None:
    """Once the worker's `session`th Execute stream has a plan, it fails with `code` (UNAVAILABLE: the
    worker died with that step in flight)."""
    await eventually(lambda: len(worker.streams) > session and worker.streams[session].plans)
    worker.streams[session].responses.put_nowait(rpc_error(code, details))


def errors_sent(servicer: Servicer) -> list:
    """The messages to the replica that ended a request with an error."""
    return [m for m in servicer.streams["127.0.0.1:1"][0].messages if any(m.errors)]


def test_a_lost_worker_that_comes_back_gets_every_request_again():
    async def main() -> None:
        worker = FakeWorker()
        async with with_worker(worker, worker_retry=Backoff(0.01)) as servicer:
            serving: list[bool] = []
            servicer.session.on_serving = serving.append
            await servicer.submit(0)
            first = worker.streams[0]
            await eventually(lambda: first.plans)
            assert first.plans[0].step == 0
            handle = first.plans[0].new_requests[0].handle
            first.responses.put_nowait(result_to_proto(StepResult(0, [handle], [42])))
            await eventually(lambda: servicer.session.scheduler.requests["f/0"].output_token_ids == [42])
            worker.down = True  # it dies with step 1 in flight...
            await fail_stream(worker, details="Socket closed")
            await eventually(lambda: serving == [False])
            await eventually(lambda: worker.refusals >= 3)  # asked again and again while it is away...
            assert len(worker.streams) == 1 and first.cancelled  # ...and no stream opened meanwhile
            with pytest.raises(Aborted) as refused:  # new requests go to another group (or wait at the frontend)
                await servicer.submit(1)
            assert refused.value.code == grpc.StatusCode.UNAVAILABLE
            worker.down = False  # ...and comes back
            await eventually(lambda: len(worker.streams) == 2 and worker.streams[1].plans)
            assert serving == [False, True] and servicer.session.worker_failovers == 1
            replay = worker.streams[1].plans[0]
            assert replay.step == 0 and not replay.removed_handles  # a new session, from step 0
            assert [tuple(r.token_ids) for r in replay.new_requests] == [(1, 2, 3, 42)]
            assert all(r.num_computed_tokens == 0 for r in replay.new_requests)
            assert await servicer.submit(2)  # serving again
            stream = servicer.streams["127.0.0.1:1"][0]
            assert not any(m.errors and any(m.errors) for m in stream.messages), "nobody was told of the loss"

    asyncio.run(main())


def test_a_worker_that_dies_between_steps_is_recovered_at_the_next_plan():
    """Its stream ends while no step is in flight, so nothing reads the failure: the next plan's
    write finds the call finished, which is the worker gone (waited for), not a refusal."""
    async def main() -> None:
        worker = FakeWorker()
        async with with_worker(worker, worker_retry=Backoff(0.01)) as servicer:
            await eventually(lambda: worker.streams)
            worker.down = True
            worker.streams[0].ended = rpc_error(grpc.StatusCode.UNAVAILABLE, "Socket closed")
            await servicer.submit(0)
            await eventually(lambda: worker.refusals >= 1)  # waited for, not failed
            worker.down = False
            await eventually(lambda: len(worker.streams) == 2 and worker.streams[1].plans)
            assert [tuple(r.token_ids) for r in worker.streams[1].plans[0].new_requests] == [(1, 2, 3)]
            assert servicer.session.failure is None and servicer.session.worker_failovers == 1

    asyncio.run(main())


def test_a_worker_gone_past_the_recovery_timeout_fails_its_requests_until_it_returns():
    async def main() -> None:
        worker = FakeWorker()
        async with with_worker(worker, worker_retry=Backoff(0.01), worker_recovery_timeout_s=0.1) as servicer:
            await servicer.submit(0)
            worker.down = True
            await fail_stream(worker)
            await eventually(lambda: errors_sent(servicer))
            ended = errors_sent(servicer)[0]
            assert "unavailable" in ended.errors[0] and ended.finish_reasons[0] == common_pb2.FINISH_REASON_ABORT
            assert not servicer.session.scheduler.has_unfinished() and not servicer.session.router.routes
            with pytest.raises(Aborted) as refused:
                await servicer.submit(1)
            assert refused.value.code == grpc.StatusCode.UNAVAILABLE
            worker.down = False
            await eventually(lambda: servicer.session.failure is None)
            assert await servicer.submit(2)  # serving again

    asyncio.run(main())


@pytest.mark.parametrize("code", [grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED])
def test_a_worker_that_refuses_a_plan_is_not_retried(code):
    """Only a worker that went away (or was taken over: tests/unit/test_stream_ownership.py) is
    waited for: a refused plan (a bug), or any other error, would recur."""
    async def main() -> None:
        worker = FakeWorker()
        async with with_worker(worker) as servicer:
            await servicer.submit(0)
            await fail_stream(worker, code=code, details="refused")
            await eventually(servicer.session.engine_loop.done)
            assert servicer.session.failure and len(worker.streams) == 1 and not servicer.session.router.routes

    asyncio.run(main())


def test_a_request_the_worker_keeps_dying_on_is_failed_not_recomputed_forever():
    async def main() -> None:
        worker = FakeWorker()
        async with with_worker(worker, worker_retry=Backoff(0.001)) as servicer:
            await servicer.submit(0)
            for attempt in range(3):  # each new session gets the request, and the worker dies on it
                await fail_stream(worker, attempt)
            await eventually(lambda: errors_sent(servicer))
            assert "each time" in errors_sent(servicer)[0].errors[0]
            assert servicer.session.worker_failovers == 3 and not servicer.session.scheduler.has_unfinished()
            await eventually(lambda: servicer.session.failure is None and not servicer.session.recovering)
            assert await servicer.submit(1)  # the others are served

    asyncio.run(main())


def test_a_worker_that_comes_back_different_makes_the_scheduler_restart():
    async def main() -> None:
        worker = FakeWorker()
        async with with_worker(worker, worker_retry=Backoff(0.001)) as servicer:
            fatal: list[str] = []
            servicer.session.on_fatal = fatal.append
            original = worker.GetWorkerInfo

            async def smaller_cache(request, **kwargs):
                info = await original(request)
                info.num_kv_blocks = 8  # e.g. a GPU with less free memory this time
                return info

            worker.GetWorkerInfo = smaller_cache
            await servicer.submit(0)
            await fail_stream(worker)
            await eventually(servicer.session.engine_loop.done)
            assert fatal and "8 KV blocks" in fatal[0] and "16 KV blocks" in fatal[0]

    asyncio.run(main())
