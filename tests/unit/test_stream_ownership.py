"""Who owns a stream when a second caller opens one under the same name: the newest wins, and the
one it displaced is told at once (never left open and starved), so that its rightful owner's
reconnect loop takes it back. Driven without a network."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from tests.support.grpc_fakes import Aborted, FakeContext
from tests.unit.test_worker_server import StepCountingRunner
from vmesh.services.detokenizer.server import DetokenizerServicer
from vmesh.services.worker.server import WorkerServicer
from vmesh.v1 import detokenizer_pb2, worker_pb2


async def _plans(queue: asyncio.Queue):
    while (plan := await queue.get()) is not None:
        yield plan


def test_an_idle_scheduler_stream_is_ended_at_once_when_another_takes_the_worker():
    """Not only at its next plan: an idle scheduler would otherwise notice only when a request
    came, and a stranger that opened a stream and left would have taken the worker for good."""
    async def main() -> None:
        servicer = WorkerServicer(StepCountingRunner(), "m")
        owner_plans: asyncio.Queue = asyncio.Queue()
        owner = servicer.Execute(_plans(owner_plans), FakeContext())
        owner_plans.put_nowait(worker_pb2.ExecuteRequest(step=0))
        assert (await owner.__anext__()).step == 0
        waiting = asyncio.ensure_future(owner.__anext__())  # idle: no plan will come

        stranger = servicer.Execute(_plans(asyncio.Queue()), FakeContext())
        strangers_read = asyncio.ensure_future(stranger.__anext__())
        with pytest.raises(Aborted) as err:
            await asyncio.wait_for(waiting, 30)
        assert err.value.code == grpc.StatusCode.ABORTED

        # The owner opens a new session (its reconnect): the stranger's stream ends in turn.
        again: asyncio.Queue = asyncio.Queue()
        reclaimed = servicer.Execute(_plans(again), FakeContext())
        again.put_nowait(worker_pb2.ExecuteRequest(step=0))
        assert (await reclaimed.__anext__()).step == 0
        with pytest.raises(Aborted) as err:
            await asyncio.wait_for(strangers_read, 30)
        assert err.value.code == grpc.StatusCode.ABORTED
        again.put_nowait(None)
        servicer.executor.shutdown()

    asyncio.run(main())


def test_a_displaced_subscription_ends_and_its_owner_takes_the_id_back():
    async def main() -> None:
        servicer = DetokenizerServicer(None)

        def subscribe():
            return servicer.Subscribe(detokenizer_pb2.SubscribeRequest(frontend_id="f"), FakeContext())

        owner = subscribe()
        owners_read = asyncio.ensure_future(owner.__anext__())
        await asyncio.sleep(0)
        owners_queue = servicer.subscribers["f"]
        stranger = subscribe()
        strangers_read = asyncio.ensure_future(stranger.__anext__())
        with pytest.raises(Aborted) as err:
            await asyncio.wait_for(owners_read, 30)
        assert err.value.code == grpc.StatusCode.ABORTED
        assert servicer.subscribers["f"] is not owners_queue  # the stranger's, for now

        reclaimed = subscribe()  # the owner subscribes again
        reclaimed_read = asyncio.ensure_future(reclaimed.__anext__())
        with pytest.raises(Aborted):
            await asyncio.wait_for(strangers_read, 30)
        # The stranger's leaving neither unsubscribed the owner nor orphaned its requests.
        batch = detokenizer_pb2.SubscribeResponse(frontend_keys=[7])
        servicer.subscribers["f"].put_nowait(batch)
        assert await asyncio.wait_for(reclaimed_read, 30) == batch
        await reclaimed.aclose()
        assert "f" not in servicer.subscribers

    asyncio.run(main())


def test_a_scheduler_whose_worker_is_taken_over_takes_it_back_and_recomputes():
    from tests.support.eventually import eventually
    from tests.unit.test_scheduler_server import FakeWorker, fail_stream, with_worker
    from vmesh.services.common.runtime.retry import Backoff

    async def main() -> None:
        worker = FakeWorker()
        async with with_worker(worker, worker_retry=Backoff.none()) as servicer:
            servicer.session.workers.take_back = Backoff.none()
            await servicer.submit(0)
            await fail_stream(worker, code=grpc.StatusCode.ABORTED, details="a newer stream took over")
            await eventually(lambda: len(worker.streams) == 2 and worker.streams[1].plans)
            assert servicer.session.failure is None and servicer.session.worker_failovers == 1
            assert list(worker.streams[1].plans[0].new_requests[0].token_ids) == [1, 2, 3]  # recomputed
            assert servicer.session.workers.takeovers == 1

    asyncio.run(main())


def test_a_second_claim_of_a_request_key_is_refused_and_the_first_runs_on():
    from tests.unit.test_scheduler_server import Servicer, connected

    async def main() -> None:
        servicer = Servicer(["127.0.0.1:1"])
        await connected(servicer)
        await servicer.submit(5)
        with pytest.raises(Aborted) as err:
            await servicer.submit(5)
        assert err.value.code == grpc.StatusCode.ALREADY_EXISTS
        assert list(servicer.session.core().requests) == ["f/5"]
        assert "f/5" in servicer.session.router.routes

    asyncio.run(main())


def test_a_plan_written_to_a_stream_the_worker_ended_raises_the_status_it_ended_with():
    """A scheduler often writes its next plan before it reads: the stream's own ending (ABORTED
    when taken over, UNAVAILABLE when the worker died) must decide what it does, not the write's
    'RPC already finished'."""
    from tests.support.grpc_fakes import FakeStream, rpc_error
    from vmesh.services.common.step_types import StepPlan
    from vmesh.services.scheduler.worker_ranks import WorkerRanks

    class EndedStream(FakeStream):
        async def write(self, message) -> None:
            raise asyncio.InvalidStateError("RPC already finished.")

    async def main() -> grpc.StatusCode:
        ranks = WorkerRanks(["worker:1"])
        ended = EndedStream()
        ended.responses.put_nowait(rpc_error(grpc.StatusCode.ABORTED, "a newer scheduler stream took over"))
        ranks.calls = [ended]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await ranks.send(StepPlan(0), worker_pb2.ExecuteRequest())
        return err.value.code()

    assert asyncio.run(main()) == grpc.StatusCode.ABORTED


def test_a_plan_write_whose_stream_status_was_lost_is_recovered_as_a_takeover():
    """grpc.aio reports a write that lost the race with the stream's end as INTERNAL 'Internal
    error from Core', dropping the worker's own status (grpc/grpc#36066): the scheduler must not
    take that for a worker bug and fail every request, but reopen and recompute."""
    from tests.support.eventually import eventually
    from tests.support.grpc_fakes import rpc_error
    from tests.unit.test_scheduler_server import FakeWorker, with_worker
    from vmesh.services.common.runtime.retry import Backoff

    class StatusLostOnce(FakeWorker):
        def Execute(self):
            stream = super().Execute()
            if len(self.streams) == 1:
                async def lost_status(message) -> None:
                    raise rpc_error(grpc.StatusCode.INTERNAL, "Internal error from Core")
                stream.write = lost_status
            return stream

    async def main() -> None:
        worker = StatusLostOnce()
        async with with_worker(worker, worker_retry=Backoff.none()) as servicer:
            servicer.session.workers.take_back = Backoff.none()
            await servicer.submit(0)  # its plan's write fails
            await eventually(lambda: len(worker.streams) == 2 and worker.streams[1].plans)
            assert servicer.session.failure is None and servicer.session.worker_failovers == 1
            assert list(worker.streams[1].plans[0].new_requests[0].token_ids) == [1, 2, 3]
            assert servicer.session.workers.takeovers == 1

    asyncio.run(main())
