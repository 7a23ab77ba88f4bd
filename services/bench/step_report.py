"""`vmesh bench serving`'s view of the step timeline (services/common/step_timeline.py): how busy
the worker was over the run's wall time, how long it stood idle between steps, the cores each
process used; and the same for the in-process engine, driven by the same schedule, as the
reference a mesh's worker should match."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from vmesh.services.bench.common import timed_outputs
from vmesh.services.bench.mesh import RunningMesh
from vmesh.services.common.step_timeline import Distribution, TimelineSummary, WorkerTimeline
from vmesh.services.common.step_types import StepPlan, StepResult
from vmesh.services.common.types import SamplingParams
from vmesh.services.common.wire.step import summary_from_proto
from vmesh.v1 import worker_pb2, worker_pb2_grpc


def _worker_name(mesh: RunningMesh) -> str:
    return "worker" if "worker" in mesh.services else "worker-rank0"  # a TP group's rank 0


async def worker_timeline(mesh: RunningMesh, since: int = 0) -> tuple[int, TimelineSummary]:
    """The mesh worker's step count so far, and its timeline from step `since` on."""
    async with mesh.channel(_worker_name(mesh)) as ch:
        stats = await worker_pb2_grpc.WorkerServiceStub(ch).GetWorkerStats(
            worker_pb2.GetWorkerStatsRequest(timeline_from_step=since))
    return stats.steps, summary_from_proto(stats.timeline)


def _ms(d: Distribution) -> dict[str, float]:
    return {"p50": 1e3 * d.p50, "p90": 1e3 * d.p90, "p99": 1e3 * d.p99, "max": 1e3 * d.max, "mean": 1e3 * d.mean}


def step_report(summary: TimelineSummary, elapsed: float, cpu: dict[str, float]) -> dict[str, Any]:
    """The worker's busy fraction of the run's wall time (`elapsed`, the client's), the cores
    each process used (CPU seconds over `elapsed`) and the worker's gaps between steps."""
    return {
        "worker_busy_fraction": summary.busy_seconds / elapsed if elapsed else 0.0,
        "worker_steps": summary.steps, "rows_per_step_mean": summary.rows.mean,
        "cores": {name: seconds / elapsed for name, seconds in cpu.items()} if elapsed else {},
        "worker_idle_gap_ms": _ms(summary.idle_gap), "worker_idle_ms_total": 1e3 * summary.idle_gap.mean
        * summary.idle_gap.count,
        "worker_waited_for_plan_ms": _ms(summary.waited_for_plan), "worker_plan_wait_ms": _ms(summary.plan_wait),
        "worker_plan_decode_ms": _ms(summary.plan_decode), "worker_result_encode_ms": _ms(summary.result_encode),
    }


def print_step_report(label: str, report: dict[str, Any]) -> None:
    gap = report["worker_idle_gap_ms"]
    print(f"  [{label}] worker busy {100 * report['worker_busy_fraction']:.1f} % of wall time over "
          f"{report['worker_steps']} steps ({report['rows_per_step_mean']:.1f} rows each); idle gap ms p50 "
          f"{gap['p50']:.2f} p90 {gap['p90']:.2f} p99 {gap['p99']:.2f} max {gap['max']:.2f}")
    for name in ("worker_waited_for_plan_ms", "worker_plan_wait_ms", "worker_result_encode_ms"):
        if name in report:
            d = report[name]
            print(f"    {name[7:]}: p50 {d['p50']:.3f} p99 {d['p99']:.3f} max {d['max']:.3f}")
    if report["cores"]:
        print("    cores used: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(report["cores"].items())))


class TimedRunner:
    """A model runner whose steps land on a WorkerTimeline: the engine's worker thread, measured
    as the mesh's worker measures itself. The engine hands a plan straight to its thread, so a
    plan is 'read' when that thread starts it."""

    def __init__(self, execute: Callable[[StepPlan], StepResult]):
        self._execute = execute
        self.timeline = WorkerTimeline()

    def execute(self, plan: StepPlan) -> StepResult:
        started = time.perf_counter()
        result = self._execute(plan)
        timing = self.timeline.executed(plan.step, len(plan.scheduled_handles), plan.total_scheduled_tokens,
                                        started, started, started, time.perf_counter(), result.forward_seconds,
                                        result.sampling_seconds)
        self.timeline.sent(timing, time.perf_counter(), 0.0)
        return result


@contextlib.contextmanager
def engine_sender(model_dir: Path, kv_cache_memory: int, dtype: str | None = None, weights: str | None = None
                  ) -> Iterator[tuple[Callable[..., Any], TimedRunner]]:
    """An in-process engine streaming requests as the mesh does, and its timed runner. The
    engine's steps run on its own thread; the client's event loop shares this process with it."""
    from vmesh.services.engine.llm import EngineConfig, LLMEngine, serving_scheduler_defaults
    from vmesh.services.worker.model_runner import WorkerConfig

    worker = WorkerConfig(model=str(model_dir), kv_cache_memory=kv_cache_memory)
    if dtype:
        worker.dtype = dtype
    if weights:
        worker.weights = weights
    # The mesh's scheduler settings (SchedulerSettings' defaults), not the offline engine's.
    engine = LLMEngine.from_config(EngineConfig(worker=worker, **serving_scheduler_defaults()))
    timed = TimedRunner(engine.runner.execute)
    engine.runner.execute = timed.execute  # type: ignore[method-assign]  # the engine calls runner.execute

    async def send(prompt: list[int], max_tokens: int) -> dict[str, Any]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return await timed_outputs(engine.stream(prompt, params), lambda out: len(out.new_token_ids))

    try:
        yield send, timed
    finally:
        engine.shutdown()
