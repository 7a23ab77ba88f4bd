"""The scheduler service over its DetokenizerRouter: where submissions go, what a replica's word or loss
does to the scheduler's queues, and refused submissions; driven without a network."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from tests.support.grpc_fakes import Aborted, FakeChannel, FakeContext, FakeStream, rpc_error
from vmesh.services.common.request_checks import MAX_STOP_TOKEN_IDS
from vmesh.services.common.step_types import StepResult
from vmesh.services.common.types import ModelLimits
from vmesh.services.common.wire.step import result_to_proto
from vmesh.services.scheduler import detokenizer_router
from vmesh.services.scheduler.block_pool import BlockPool
from vmesh.services.scheduler.pipeline import StepPipeline
from vmesh.services.scheduler.scheduler import Scheduler, SchedulerConfig
from vmesh.services.scheduler.server import MeshSchedulerConfig, SchedulerServicer
from vmesh.v1 import common_pb2, detokenizer_pb2, scheduler_pb2, worker_pb2


class Servicer(SchedulerServicer):
    """Streams to fake replicas; addresses resolve through `dns`."""

    def __init__(self, addresses: list[str]):
        super().__init__(MeshSchedulerConfig(worker_addresses=[], detokenizer_addresses=addresses),
                         open_detokenizer_stream=self._open_stream)
        self.streams: dict[str, list[FakeStream]] = {}
        self.scheduler = Scheduler(SchedulerConfig(max_model_len=64), BlockPool(16, 4), (0,))
        self.limits = ModelLimits("tiny", max_model_len=64, vocab_size=100)

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
    await servicer.router.connect(servicer.detokenizers.addresses)


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
        await servicer.close()

    asyncio.run(main())


def test_a_replica_that_leaves_finishes_its_requests_and_then_closes():
    async def main() -> None:
        servicer = Servicer(["127.0.0.1:1"])
        await connected(servicer)
        assert await servicer.submit(0) == "127.0.0.1:1"
        servicer.router.replicas.update(["127.0.0.1:2"], ["127.0.0.1:1"])
        await servicer.router.replicas.members["127.0.0.1:2"].connected.wait()
        leaving = servicer.router.replicas.members["127.0.0.1:1"]
        assert leaving.retired and leaving.alive  # r0 still streams there
        assert await servicer.submit(1) == "127.0.0.1:2"
        r0 = servicer._release("f/0")
        servicer.router.add_end(r0)  # its last output is queued for the leaving replica...
        assert "127.0.0.1:1" in servicer.router.replicas
        await servicer.router.flush()  # ...and written before the replica is let go
        assert servicer.streams["127.0.0.1:1"][0].received == [[r0.stream_handle]]
        assert "127.0.0.1:1" not in servicer.router.replicas
        await asyncio.sleep(0)
        assert leaving.task.done()
        await servicer.close()

    asyncio.run(main())


def test_a_lost_stream_fails_its_requests_and_reconnects(monkeypatch):
    monkeypatch.setattr(detokenizer_router, "RECONNECT_DELAY_S", 0.0)

    async def main() -> None:
        servicer = Servicer(["127.0.0.1:1"])
        await connected(servicer)
        await servicer.submit(0)
        first = servicer.streams["127.0.0.1:1"][0]
        first.responses.put_nowait(ConnectionError("reset by peer"))
        for _ in range(50):
            await asyncio.sleep(0)
        assert first.cancelled
        assert "f/0" not in servicer.router.routes and not servicer.scheduler.has_unfinished()
        assert len(servicer.streams["127.0.0.1:1"]) == 2  # reopened
        assert servicer.router.replicas.members["127.0.0.1:1"].alive
        assert await servicer.submit(1) == "127.0.0.1:1"
        await servicer.close()

    asyncio.run(main())


def test_a_draining_replica_gets_no_new_requests_until_it_restarts(monkeypatch):
    monkeypatch.setattr(detokenizer_router, "RECONNECT_DELAY_S", 0.0)

    async def main() -> None:
        servicer = Servicer(["127.0.0.1:1", "127.0.0.1:2"])
        await connected(servicer)
        servicer.streams["127.0.0.1:1"][0].responses.put_nowait(detokenizer_pb2.DetokenizeResponse(
            draining=True))
        for _ in range(10):
            await asyncio.sleep(0)
        assert servicer.router.replicas.members["127.0.0.1:1"].draining
        assert {await servicer.submit(i) for i in range(3)} == {"127.0.0.1:2"}
        servicer.streams["127.0.0.1:1"][0].responses.put_nowait(ConnectionError("it exited"))  # ...and comes back
        for _ in range(50):
            await asyncio.sleep(0)
        assert len(servicer.streams["127.0.0.1:1"]) == 2
        assert await servicer.submit(3) == "127.0.0.1:1"
        await servicer.close()

    asyncio.run(main())


def test_requests_the_detokenizer_reports_orphaned_are_stopped():
    async def main() -> None:
        servicer = Servicer(["127.0.0.1:1"])
        await connected(servicer)
        await servicer.submit(0)
        await servicer.submit(1)
        handle = servicer.router.routes["f/0"].stream_handle
        servicer.streams["127.0.0.1:1"][0].responses.put_nowait(detokenizer_pb2.DetokenizeResponse(
            orphaned_handles=[handle, 999]))  # 999: unknown, or already gone
        for _ in range(10):
            await asyncio.sleep(0)
        assert "f/0" not in servicer.router.routes and "f/1" in servicer.router.routes
        assert servicer.scheduler.stats().num_waiting == 1
        assert servicer.router.replicas.members["127.0.0.1:1"].outstanding == 1
        await servicer.close()

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
        assert not servicer.scheduler.has_unfinished() and not servicer.router.routes
        assert await servicer.submit(2)  # the next one is served
        await servicer.close()

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
        request = servicer.scheduler.requests["f/2"]
        assert request.output_token_ids == [7, 8] and request.all_token_ids == [1, 2, 3, 7, 8]
        introduction = servicer.router.routes["f/2"].introduction
        assert list(introduction.resumed_output_token_ids) == [7, 8] and introduction.resumed_text_length == 3
        assert introduction.num_prompt_tokens == 3
        await servicer.close()

    asyncio.run(main())


class FakeExecute(FakeStream):
    """A worker's Execute stream: plans written are kept; results are fed to `responses`."""

    def __init__(self) -> None:
        super().__init__()
        self.plans: list[worker_pb2.ExecuteRequest] = []

    async def write(self, message) -> None:
        self.plans.append(message)


class FakeWorker:
    """A worker rank's stub: UNAVAILABLE while `down` (dead, or loading its model)."""

    def __init__(self) -> None:
        self.down = False
        self.streams: list[FakeExecute] = []

    async def GetWorkerInfo(self, request, **kwargs):
        if self.down:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE)
        return worker_pb2.GetWorkerInfoResponse(model_name="tiny", num_kv_blocks=16, block_size=4,
                                                max_model_len=64, vocab_size=100, max_num_seqs=8)

    def Execute(self):
        self.streams.append(FakeExecute())
        return self.streams[-1]


async def settle(condition, limit: int = 2000) -> None:
    for _ in range(limit):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("the condition never held")


async def with_worker(servicer: Servicer, worker: FakeWorker) -> asyncio.Task:
    """Wire the servicer to `worker` as connect() would, and start its engine loop."""
    servicer._worker_stubs = [worker]
    servicer.info = await servicer._open_worker_streams(timeout=1)
    servicer.pipeline = StepPipeline(servicer.scheduler, 2)
    await connected(servicer)
    return asyncio.create_task(servicer._engine_loop())


def test_a_lost_worker_that_comes_back_gets_every_request_again(monkeypatch):
    monkeypatch.setattr("vmesh.services.scheduler.server.WORKER_RETRY_S", 0.01)

    async def main() -> None:
        servicer = Servicer(["127.0.0.1:1"])
        serving: list[bool] = []
        servicer.on_serving = serving.append
        worker = FakeWorker()
        loop = await with_worker(servicer, worker)
        await servicer.submit(0)
        first = worker.streams[0]
        await settle(lambda: first.plans)
        assert first.plans[0].step == 0
        handle = first.plans[0].new_requests[0].handle
        first.responses.put_nowait(result_to_proto(StepResult(0, [handle], [42])))
        await settle(lambda: servicer.scheduler.requests["f/0"].output_token_ids == [42])
        worker.down = True  # it dies with step 1 in flight...
        first.responses.put_nowait(rpc_error(grpc.StatusCode.UNAVAILABLE, "Socket closed"))
        await settle(lambda: serving == [False])
        await asyncio.sleep(0.05)
        assert len(worker.streams) == 1 and first.cancelled
        with pytest.raises(Aborted) as refused:  # new requests go to another group (or wait at the frontend)
            await servicer.submit(1)
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE
        worker.down = False  # ...and comes back
        await settle(lambda: len(worker.streams) == 2 and worker.streams[1].plans)
        assert serving == [False, True] and servicer.worker_failovers == 1
        replay = worker.streams[1].plans[0]
        assert replay.step == 0 and not replay.removed_handles  # a new session, from step 0
        assert [tuple(r.token_ids) for r in replay.new_requests] == [(1, 2, 3, 42)]
        assert all(r.num_computed_tokens == 0 for r in replay.new_requests)
        assert await servicer.submit(2)  # serving again
        stream = servicer.streams["127.0.0.1:1"][0]
        assert not any(m.errors and any(m.errors) for m in stream.messages), "nobody was told of the loss"
        loop.cancel()
        await servicer.close()

    asyncio.run(main())


def test_a_worker_gone_past_the_recovery_timeout_fails_its_requests_until_it_returns(monkeypatch):
    monkeypatch.setattr("vmesh.services.scheduler.server.WORKER_RETRY_S", 0.01)

    async def main() -> None:
        servicer = Servicer(["127.0.0.1:1"])
        servicer.config.worker_recovery_timeout_s = 0.1
        worker = FakeWorker()
        loop = await with_worker(servicer, worker)
        await servicer.submit(0)
        await settle(lambda: worker.streams[0].plans)
        worker.down = True
        worker.streams[0].responses.put_nowait(rpc_error(grpc.StatusCode.UNAVAILABLE))
        stream = servicer.streams["127.0.0.1:1"][0]
        await settle(lambda: any(any(m.errors) for m in stream.messages))
        ended = next(m for m in stream.messages if any(m.errors))
        assert "unavailable" in ended.errors[0] and ended.finish_reasons[0] == common_pb2.FINISH_REASON_ABORT
        assert not servicer.scheduler.has_unfinished() and not servicer.router.routes
        with pytest.raises(Aborted) as refused:
            await servicer.submit(1)
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE
        worker.down = False
        await settle(lambda: servicer.failure is None)
        assert await servicer.submit(2)  # serving again
        loop.cancel()
        await servicer.close()

    asyncio.run(main())


@pytest.mark.parametrize("code", [grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ABORTED,
                                  grpc.StatusCode.RESOURCE_EXHAUSTED])
def test_a_worker_that_refuses_a_plan_or_is_taken_over_is_not_retried(code):
    """Only a worker that went away is waited for: a refused plan (a bug), another scheduler taking
    the worker over, or any other error would recur, and two schedulers would take one worker
    from each other forever."""
    async def main() -> None:
        servicer = Servicer(["127.0.0.1:1"])
        worker = FakeWorker()
        loop = await with_worker(servicer, worker)
        await servicer.submit(0)
        await settle(lambda: worker.streams[0].plans)
        worker.streams[0].responses.put_nowait(rpc_error(code, "refused"))
        await settle(loop.done)
        assert servicer.failure and len(worker.streams) == 1 and not servicer.router.routes
        await servicer.close()

    asyncio.run(main())


def test_a_request_the_worker_keeps_dying_on_is_failed_not_recomputed_forever(monkeypatch):
    monkeypatch.setattr("vmesh.services.scheduler.server.WORKER_RETRY_S", 0.001)

    async def main() -> None:
        servicer = Servicer(["127.0.0.1:1"])
        worker = FakeWorker()
        loop = await with_worker(servicer, worker)
        await servicer.submit(0)
        for attempt in range(3):  # each new session gets the request, and the worker dies on it
            await settle(lambda n=attempt: len(worker.streams) == n + 1 and worker.streams[n].plans)
            worker.streams[attempt].responses.put_nowait(rpc_error(grpc.StatusCode.UNAVAILABLE))
        stream = servicer.streams["127.0.0.1:1"][0]
        await settle(lambda: any(any(m.errors) for m in stream.messages))
        assert "each time" in next(m for m in stream.messages if any(m.errors)).errors[0]
        assert servicer.worker_failovers == 3 and not servicer.scheduler.has_unfinished()
        await settle(lambda: servicer.failure is None and not servicer.recovering)
        assert await servicer.submit(1)  # the others are served
        loop.cancel()
        await servicer.close()

    asyncio.run(main())


def test_a_worker_that_comes_back_different_makes_the_scheduler_restart(monkeypatch):
    monkeypatch.setattr("vmesh.services.scheduler.server.WORKER_RETRY_S", 0.001)

    async def main() -> None:
        servicer = Servicer(["127.0.0.1:1"])
        fatal: list[str] = []
        servicer.on_fatal = fatal.append
        worker = FakeWorker()
        loop = await with_worker(servicer, worker)
        original = worker.GetWorkerInfo

        async def smaller_cache(request, **kwargs):
            info = await original(request)
            info.num_kv_blocks = 8  # e.g. a GPU with less free memory this time
            return info

        worker.GetWorkerInfo = smaller_cache
        await servicer.submit(0)
        await settle(lambda: worker.streams[0].plans)
        worker.streams[0].responses.put_nowait(rpc_error(grpc.StatusCode.UNAVAILABLE))
        await settle(loop.done)
        assert fatal and "8 KV blocks" in fatal[0] and "16 KV blocks" in fatal[0]
        await servicer.close()

    asyncio.run(main())
