"""The worker service's scheduler sessions, with a stand-in runner (no model)."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from tests.support.grpc_fakes import Aborted, FakeContext
from vmesh.services.common.step_types import StepResult
from vmesh.services.worker.persistent_batch import PlanError
from vmesh.services.worker.server import WorkerServicer
from vmesh.v1 import worker_pb2


class StepCountingRunner:
    """Checks step numbering like the real runner; `reset` restarts it."""

    def __init__(self) -> None:
        self.last_step = -1
        self.resets = 0

    def reset(self) -> None:
        self.last_step = -1
        self.resets += 1

    def execute(self, plan) -> StepResult:
        if plan.step != self.last_step + 1:
            raise PlanError(f"step {plan.step} does not follow step {self.last_step}")
        self.last_step = plan.step
        return StepResult(step=plan.step, handles=[], sampled_token_ids=[])


def test_a_new_scheduler_stream_takes_over_and_the_old_one_is_refused():
    async def main() -> None:
        servicer = WorkerServicer(StepCountingRunner(), "m")
        old_plans: asyncio.Queue = asyncio.Queue()

        async def plans(queue: asyncio.Queue):
            while (plan := await queue.get()) is not None:
                yield plan

        old = servicer.Execute(plans(old_plans), FakeContext())
        for step in range(3):
            old_plans.put_nowait(worker_pb2.ExecuteRequest(step=step))
            assert (await old.__anext__()).step == step

        new_plans: asyncio.Queue = asyncio.Queue()
        new = servicer.Execute(plans(new_plans), FakeContext())
        new_plans.put_nowait(worker_pb2.ExecuteRequest(step=0))  # a restarted scheduler counts from 0 again
        assert (await new.__anext__()).step == 0

        old_plans.put_nowait(worker_pb2.ExecuteRequest(step=3))
        with pytest.raises(Aborted) as err:
            await old.__anext__()
        assert err.value.code == grpc.StatusCode.ABORTED
        new_plans.put_nowait(worker_pb2.ExecuteRequest(step=1))
        assert (await new.__anext__()).step == 1
        assert servicer.runner.resets == 2
        new_plans.put_nowait(None)
        servicer.executor.shutdown()

    asyncio.run(main())
