"""The step timeline's arithmetic on synthetic timestamps, and its fields across the wire."""

from __future__ import annotations

import pytest

from vmesh.services.common.step_timeline import Distribution, SchedulerTimeline, WorkerTimeline
from vmesh.services.common.step_types import StepResult
from vmesh.services.common.wire.step import (
    result_from_proto,
    result_to_proto,
    summary_from_proto,
    summary_to_proto,
)


def run_step(timeline: WorkerTimeline, step: int, received: float, started: float, ended: float,
             sent: float, rows: int = 4) -> None:
    """A step whose plan decodes in 1 ms, forward is 70 % of the execution and sampling 10 %."""
    execute = ended - started - 0.001
    timing = timeline.executed(step, rows, rows, received, started, started + 0.001, ended, 0.7 * execute,
                               0.1 * execute)
    timeline.sent(timing, sent, encode_seconds=sent - ended)


def test_gaps_between_steps_split_into_handing_over_waiting_and_queueing():
    timeline = WorkerTimeline()
    run_step(timeline, 0, received=10.000, started=10.001, ended=10.051, sent=10.052)
    # Plan 1 was read 3 ms after result 0 was handed over (the scheduler was late), and waited
    # 0.5 ms for the model thread.
    timing = timeline.executed(1, 4, 4, received=10.055, started=10.0555, decoded=10.0565, ended=10.1065,
                               forward_seconds=0.04, sampling_seconds=0.005)
    assert timing.idle_before_seconds == pytest.approx(0.0045)  # 10.051 -> 10.0555
    assert timing.waited_for_plan_seconds == pytest.approx(0.003)  # 10.052 -> 10.055
    assert timing.plan_wait_seconds == pytest.approx(0.0005)
    assert timing.plan_decode_seconds == pytest.approx(0.001)
    assert timing.execute_seconds == pytest.approx(0.05)
    assert timing.received_to_done_seconds == pytest.approx(0.0515)
    assert timing.busy_seconds == pytest.approx(0.045)


def test_a_session_first_step_has_no_gap_and_a_summary_starts_at_its_mark():
    timeline = WorkerTimeline()
    run_step(timeline, 0, 0.0, 0.0, 1.0, 1.0)
    mark = timeline.steps
    assert mark == 1
    timeline.new_session()
    run_step(timeline, 0, 5.0, 5.0, 5.1, 5.1)  # a new scheduler: no gap back to the old session
    run_step(timeline, 1, 5.1, 5.2, 5.3, 5.3)  # 0.1 s idle
    run_step(timeline, 2, 5.3, 5.3, 5.4, 5.5)  # 0.0 s idle: plan read as the model finished
    run_step(timeline, 3, 5.8, 5.8, 5.9, 5.9)  # 0.4 s idle, 0.3 s of it waiting for the plan
    summary = timeline.summary(since=mark)
    assert summary.steps == 4
    assert summary.span_seconds == pytest.approx(0.9)  # 5.0 -> 5.9
    assert summary.idle_gap.count == 3  # the window's first step followed the mark: no gap counted
    assert summary.idle_gap.max == pytest.approx(0.4)
    assert summary.idle_gap.p50 == pytest.approx(0.1)
    assert summary.idle_gap.mean == pytest.approx(0.5 / 3)
    assert summary.waited_for_plan.max == pytest.approx(0.3)  # 5.5 -> 5.8
    assert summary.busy_seconds == pytest.approx(0.8 * (0.1 - 0.001) * 4)
    assert summary.busy_fraction == pytest.approx(summary.busy_seconds / 0.9)
    assert timeline.summary(since=timeline.steps).steps == 0


def test_distribution_percentiles_and_max():
    d = Distribution.of(float(v) for v in range(1, 101))
    assert (d.p50, d.p90, d.p99, d.max, d.count) == (51.0, 90.0, 99.0, 100.0, 100)
    assert Distribution.of([]) == Distribution()


def test_scheduler_timeline_subtracts_the_worker_interval_from_its_round_trip():
    worker = WorkerTimeline()
    worker_timing = worker.executed(7, 2, 2, received=100.0, started=100.002, decoded=100.003, ended=100.040,
                                    forward_seconds=0.03, sampling_seconds=0.005)
    scheduler = SchedulerTimeline()
    scheduler.sent(7, planning_seconds=0.0004, encode_seconds=0.0001, started=2.000, at=2.0002)
    step = scheduler.read(7, read_started=2.010, read_at=2.0452, decoded_at=2.0453, worker=worker_timing)
    assert step is not None
    assert step.round_trip_seconds == pytest.approx(0.045)
    assert step.outside_worker_seconds == pytest.approx(0.005)  # 45 ms round trip, 40 ms inside the worker
    assert step.result_wait_seconds == pytest.approx(0.0352)
    assert step.result_decode_seconds == pytest.approx(0.0001)
    assert step.send_seconds == pytest.approx(0.0002)
    assert scheduler.read(7, 3.0, 3.0, 3.0, worker_timing) is None  # each step is read once
    scheduler.sent(8, 0.0, 0.0, 4.0, 4.0)
    scheduler.forget()
    assert scheduler.read(8, 5.0, 5.0, 5.0, None) is None


def test_the_wire_carries_the_worker_timing_and_the_summary():
    timeline = WorkerTimeline()
    first = timeline.executed(0, 3, 30, 1.0, 1.001, 1.002, 1.05, 0.04, 0.005)
    timeline.sent(first, 1.051, 0.001)
    second = timeline.executed(1, 3, 3, 1.06, 1.0605, 1.061, 1.09, 0.025, 0.003)
    for timing in (first, second):
        result = StepResult(step=timing.step, handles=[1, 2, 3], sampled_token_ids=[4, 5, 6],
                            forward_seconds=timing.forward_seconds, sampling_seconds=timing.sampling_seconds,
                            timing=timing)
        back = result_from_proto(result_to_proto(result))
        assert back.timing is not None
        assert back.timing.idle_before_seconds == timing.idle_before_seconds  # None stays None
        assert back.timing.waited_for_plan_seconds == timing.waited_for_plan_seconds
        back.timing.result_encode_seconds = timing.result_encode_seconds  # the worker's own, never sent
        assert back.timing == timing
    assert result_from_proto(result_to_proto(StepResult(step=0, handles=[], sampled_token_ids=[]))).timing is None
    summary = timeline.summary()
    assert summary_from_proto(summary_to_proto(summary)) == summary


def test_the_engine_reference_times_its_runner_as_the_worker_times_itself():
    from vmesh.services.bench.step_report import TimedRunner, step_report
    from vmesh.services.common.step_types import StepPlan

    def execute(plan: StepPlan) -> StepResult:
        return StepResult(step=plan.step, handles=plan.scheduled_handles,
                          sampled_token_ids=[0] * len(plan.scheduled_handles), forward_seconds=0.02,
                          sampling_seconds=0.005)

    runner = TimedRunner(execute)
    for step in range(3):
        runner.execute(StepPlan(step, scheduled_handles=[1, 2], num_scheduled_tokens=[1, 1]))
    summary = runner.timeline.summary()
    assert summary.steps == 3 and summary.idle_gap.count == 2 and summary.rows.mean == 2
    report = step_report(summary, elapsed=0.1, cpu={"engine": 0.05})
    assert report["worker_busy_fraction"] == pytest.approx(0.75)  # 3 x 25 ms of 100 ms
    assert report["cores"] == {"engine": pytest.approx(0.5)}
    assert report["worker_steps"] == 3


def test_the_step_span_carries_the_intervals_and_the_forward_pass_bounds():
    import time

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from vmesh.services.common import telemetry

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    timeline = WorkerTimeline()
    run_step(timeline, 0, 1.0, 1.0, 1.05, 1.05)
    timing = timeline.executed(1, 2, 2, received=1.06, started=1.061, decoded=1.062, ended=1.102,
                               forward_seconds=0.03, sampling_seconds=0.01)
    with provider.get_tracer("test").start_as_current_span("worker.step") as span:
        telemetry.annotate_step(span, timing, ended=1.102, now=time.perf_counter())
    (finished,) = exporter.get_finished_spans()
    attributes = finished.attributes
    assert attributes["vmesh.step.idle_before_s"] == pytest.approx(0.011)
    assert attributes["vmesh.step.waited_for_plan_s"] == pytest.approx(0.01)
    assert attributes["vmesh.step.plan_wait_s"] == pytest.approx(0.001)
    assert attributes["vmesh.step.forward_s"] == 0.03
    events = {e.name: e.timestamp for e in finished.events}
    assert list(events) == [telemetry.FORWARD_START_EVENT, telemetry.FORWARD_END_EVENT, telemetry.SAMPLING_END_EVENT]
    assert events[telemetry.FORWARD_END_EVENT] - events[telemetry.FORWARD_START_EVENT] == pytest.approx(3e7, abs=1e3)
    assert events[telemetry.SAMPLING_END_EVENT] - events[telemetry.FORWARD_END_EVENT] == pytest.approx(1e7, abs=1e3)
