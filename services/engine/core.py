"""Scheduler and worker wired in one process, with up to `pipeline_depth` plans in flight.

The worker runs on its own thread (torch releases the GIL while it computes), so with
depth 2 the scheduler plans step N+1 while step N runs, exactly as the mesh does over gRPC.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

from vmesh.services.common.step_types import StepPlan, StepResult
from vmesh.services.scheduler.pipeline import StepPipeline
from vmesh.services.scheduler.scheduler import RequestUpdate, Scheduler
from vmesh.services.worker.model_runner import ModelRunner


def model_thread() -> ThreadPoolExecutor:
    """The one thread that should load a model and run all of its steps. OpenMP keeps a pool of
    helper threads per thread that starts parallel work: a model loaded on one thread and run
    on another leaves two pools on the cores, and the steps ran ~25 % slower for it (attention
    of 16 decodes over 2,000 tokens: 2.4 against 1.9 ms per layer, benchmarks/README.md)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="vmesh-worker")


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, pipeline_depth: int = 2,
                 model_thread: ThreadPoolExecutor | None = None):
        self.pipeline = StepPipeline(scheduler, pipeline_depth)
        self.scheduler = scheduler
        self.runner = runner
        self.pipeline_depth = pipeline_depth
        self.in_flight: deque[Future[StepResult]] = deque()
        # One thread: plans execute in the order they were sent. Best the thread that loaded
        # the model (see model_thread()).
        self._worker = model_thread or ThreadPoolExecutor(max_workers=1, thread_name_prefix="vmesh-worker")
        self.busy_seconds = 0.0

    def has_work(self) -> bool:
        return self.pipeline.has_work()

    def step(self) -> list[RequestUpdate]:
        """Fill the pipeline, then wait for the oldest step and apply its result."""
        for plan in self.pipeline.plans():
            self.in_flight.append(self._worker.submit(self._execute, plan))
        if not self.in_flight:
            return []
        try:
            result = self.in_flight.popleft().result()
        except BaseException:
            self.pipeline.abandon_oldest()  # or has_work() would stay true with nothing in flight
            raise
        return self.pipeline.complete(result)

    def _execute(self, plan: StepPlan) -> StepResult:
        result = self.runner.execute(plan)
        self.busy_seconds += result.forward_seconds + result.sampling_seconds
        return result

    def shutdown(self) -> None:
        self._worker.shutdown(wait=True, cancel_futures=True)
