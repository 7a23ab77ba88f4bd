"""The worker hands each plan to its model thread as soon as it is read: the thread never waits
for the previous result to be written before starting the next step."""
from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from tests.support.grpc_fakes import Aborted, FakeContext
from tests.unit.test_worker_server import StepCountingRunner
from vmesh.services.common.step_types import StepResult
from vmesh.services.worker.server import WorkerServicer
from vmesh.v1 import worker_pb2


class RecordingRunner(StepCountingRunner):
    """Records the steps it started; step 0 blocks until released."""

    def __init__(self) -> None:
        super().__init__()
        self.started: list[int] = []
        self.first_started = threading.Event()
        self.third_started = threading.Event()
        self.release_first = threading.Event()

    def execute(self, plan) -> StepResult:
        self.started.append(plan.step)
        if plan.step == 0:
            self.first_started.set()
        if plan.step == 2:
            self.third_started.set()
        if plan.step == 0:
            self.release_first.wait(30)
        return super().execute(plan)


async def plans(queue: asyncio.Queue):
    while (plan := await queue.get()) is not None:
        yield plan


def test_the_next_plan_is_executed_before_the_previous_result_is_taken():
    async def main() -> None:
        runner = RecordingRunner()
        servicer = WorkerServicer(runner, "m")
        queue: asyncio.Queue = asyncio.Queue()
        for step in range(3):
            queue.put_nowait(worker_pb2.ExecuteRequest(step=step))
        stream = servicer.Execute(plans(queue), FakeContext())
        first = asyncio.ensure_future(stream.__anext__())
        assert await asyncio.to_thread(runner.first_started.wait, 30)  # steps 1 and 2 queue behind it
        runner.release_first.set()
        assert (await first).step == 0
        # Result 0 is taken but 1 and 2 are not yet: both steps run meanwhile.
        assert await asyncio.to_thread(runner.third_started.wait, 30)
        assert runner.started == [0, 1, 2]
        results = [await stream.__anext__() for _ in range(2)]
        assert [r.step for r in results] == [1, 2]
        assert all(r.HasField("timing") for r in results) and results[1].timing.has_previous
        assert servicer.timeline.summary().steps == 3
        queue.put_nowait(None)
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()

    asyncio.run(main())


def test_a_refused_plan_ends_the_stream_after_the_results_before_it():
    async def main() -> None:
        servicer = WorkerServicer(StepCountingRunner(), "m")
        queue: asyncio.Queue = asyncio.Queue()
        for step in (0, 1, 5):  # 5 does not follow 1
            queue.put_nowait(worker_pb2.ExecuteRequest(step=step))
        stream = servicer.Execute(plans(queue), FakeContext())
        assert [(await stream.__anext__()).step for _ in range(2)] == [0, 1]
        with pytest.raises(Aborted) as err:
            await stream.__anext__()
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "step 5 does not follow step 1" in str(err.value)

    asyncio.run(main())
