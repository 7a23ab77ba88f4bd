"""Async scheduling's one rule, for every transport: keep up to `depth` step plans in flight
and apply results in the order the plans went out. With depth 2 the scheduler plans step N+1
while a worker computes step N; depth 1 is the synchronous loop of earlier engines.

The in-process engine (a worker thread) and the scheduler service (a gRPC Execute stream per
worker) both drive their plans through this class; only how a plan travels differs."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from vmesh.services.common.step_types import StepPlan, StepResult
from vmesh.services.scheduler.scheduler import RequestUpdate, Scheduler
from vmesh.services.scheduler.settings import PIPELINE_DEPTHS


class StepPipeline:
    def __init__(self, scheduler: Scheduler, depth: int):
        if depth not in PIPELINE_DEPTHS:
            raise ValueError(f"pipeline depth must be 1 (synchronous) or 2 (async scheduling), got {depth}")
        self.scheduler = scheduler
        self.depth = depth
        self._steps: deque[int] = deque()  # the steps in flight, oldest first

    @property
    def in_flight(self) -> int:
        return len(self._steps)

    def plans(self) -> Iterator[StepPlan]:
        """The plans to send now: scheduled one at a time while there is room in the pipeline,
        each counted in flight as it is handed out."""
        while self.in_flight < self.depth and (plan := self.scheduler.schedule()) is not None:
            self._steps.append(plan.step)
            yield plan

    def complete(self, result: StepResult) -> list[RequestUpdate]:
        """Apply the oldest plan's result; a result for any other step is refused."""
        if not self._steps:
            raise RuntimeError(f"a result for step {result.step} with no plan in flight")
        if result.step != self._steps[0]:
            raise RuntimeError(f"a result for step {result.step} while step {self._steps[0]} is the oldest in flight")
        self._steps.popleft()
        return self.scheduler.update(result)

    def abandon_oldest(self) -> None:
        """The oldest plan will never have a result (its execution failed)."""
        self._steps.popleft()

    def abandon_all(self) -> None:
        """No plan in flight will have a result (the worker that had them is gone)."""
        self._steps.clear()

    @property
    def idle(self) -> bool:
        return not self._steps

    def has_work(self) -> bool:
        return self.in_flight > 0 or self.scheduler.has_unfinished()
