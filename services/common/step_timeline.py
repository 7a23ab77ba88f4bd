"""The step timeline: where a step's time goes between the scheduler and the worker, and where
the worker waits between steps.

Each process stamps its own events on its own clock (time.perf_counter), and only intervals
cross the wire: the worker reports, with each result, how long the plan waited in it, how long
its model thread stood idle before the step, and its own plan-read -> result-sent interval; the
scheduler subtracts that interval from its own plan-sent -> result-read interval. No two
processes' clocks are ever compared, so no clock synchronisation is needed.

The worker's events for step N, in order: plan read (the servicer has the message), execution
begins (the model thread decodes the plan; then the batch update, forward and sampling), execution
ends, result handed to the transport. Its idle gap before step N is the model thread's time
between the end of step N-1 and the start of step N; it splits into handing result N-1 over
(encode and write), waiting for plan N to be read (the scheduler was late, or the servicer reads
plans only after writing results), and plan N waiting for the model thread.

Plain classes without any I/O, tested on synthetic timestamps (tests/unit/test_step_timeline.py).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

TIMELINE_CAPACITY = 1 << 16  # steps kept for summaries: minutes of decoding at tens of ms a step


@dataclass
class WorkerStepTiming:
    """One step as the worker saw it: intervals on the worker's clock, sent back with the result."""
    step: int
    rows: int  # requests scheduled in the step
    tokens: int  # tokens computed
    plan_wait_seconds: float  # plan read -> its execution began
    plan_decode_seconds: float  # the plan message turned into a StepPlan
    execute_seconds: float  # batch update + forward + sampling
    forward_seconds: float
    sampling_seconds: float
    # The model thread idle since the previous step ended; None for a session's first step.
    idle_before_seconds: float | None = None
    # The previous result handed to the transport -> this plan read; None for the first step.
    waited_for_plan_seconds: float | None = None
    # Plan read -> execution ended (the worker's share of the scheduler's round trip, but for
    # encoding and writing the result, which follow).
    received_to_done_seconds: float = 0.0
    result_encode_seconds: float = 0.0  # known once the result is written: not on the wire

    @property
    def busy_seconds(self) -> float:
        return self.forward_seconds + self.sampling_seconds


@dataclass
class Distribution:
    p50: float = 0.0
    p90: float = 0.0
    p99: float = 0.0
    max: float = 0.0
    mean: float = 0.0
    count: int = 0

    @classmethod
    def of(cls, values: Iterable[float]) -> Distribution:
        ordered = sorted(values)
        if not ordered:
            return cls()

        def pick(q: float) -> float:
            return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

        return cls(pick(0.5), pick(0.9), pick(0.99), ordered[-1], statistics.fmean(ordered), len(ordered))


@dataclass
class TimelineSummary:
    """The worker's steps since a mark: how busy it was and how it waited."""
    steps: int = 0
    busy_seconds: float = 0.0  # forward + sampling
    # First step's start -> last step's end, on the worker's clock (0 for fewer than one step).
    span_seconds: float = 0.0
    idle_gap: Distribution = field(default_factory=Distribution)  # seconds, between consecutive steps
    waited_for_plan: Distribution = field(default_factory=Distribution)
    plan_wait: Distribution = field(default_factory=Distribution)
    plan_decode: Distribution = field(default_factory=Distribution)
    result_encode: Distribution = field(default_factory=Distribution)
    rows: Distribution = field(default_factory=Distribution)

    @property
    def busy_fraction(self) -> float:
        return self.busy_seconds / self.span_seconds if self.span_seconds > 0 else 0.0


class WorkerTimeline:
    """The worker's stamps, step after step, of one or more sessions. Steps are counted across
    sessions (`steps`), so that a caller can mark a point and later summarise what followed."""

    def __init__(self, capacity: int = TIMELINE_CAPACITY):
        self.steps = 0  # executed so far, every session
        self._records: deque[tuple[int, float, float, WorkerStepTiming]] = deque(maxlen=capacity)
        self._last_end: float | None = None  # the previous step's execution end
        self._last_sent: float | None = None  # the previous result handed to the transport

    def new_session(self) -> None:
        """A new scheduler stream: its first step has no predecessor to be idle after."""
        self._last_end = self._last_sent = None

    def executed(self, step: int, rows: int, tokens: int, received: float, started: float, decoded: float,
                 ended: float, forward_seconds: float, sampling_seconds: float) -> WorkerStepTiming:
        """Step `step`'s plan was read at `received`, its execution began at `started` (plan decode
        until `decoded`) and ended at `ended`."""
        timing = WorkerStepTiming(
            step=step, rows=rows, tokens=tokens, plan_wait_seconds=started - received,
            plan_decode_seconds=decoded - started, execute_seconds=ended - decoded,
            forward_seconds=forward_seconds, sampling_seconds=sampling_seconds,
            idle_before_seconds=None if self._last_end is None else max(0.0, started - self._last_end),
            waited_for_plan_seconds=None if self._last_sent is None else max(0.0, received - self._last_sent),
            received_to_done_seconds=ended - received)
        self._records.append((self.steps, started, ended, timing))
        self.steps += 1
        self._last_end = ended
        return timing

    def sent(self, timing: WorkerStepTiming | None, at: float, encode_seconds: float) -> None:
        """The result of the step `timing` describes was handed to the transport at `at`, after
        `encode_seconds` of encoding. (The next step may have been executed meanwhile.)"""
        self._last_sent = at
        if timing is not None:
            timing.result_encode_seconds = encode_seconds

    def summary(self, since: int = 0) -> TimelineSummary:
        """The steps counted from `since` on (a value of `steps` read earlier). The first of them
        has no idle gap: it followed whatever came before the mark."""
        window = [r for r in list(self._records) if r[0] >= since]  # list(): one step, under the GIL
        if not window:
            return TimelineSummary()
        timings = [t for _n, _s, _e, t in window]
        later = timings[1:]
        return TimelineSummary(
            steps=len(window), busy_seconds=sum(t.busy_seconds for t in timings),
            span_seconds=window[-1][2] - window[0][1],
            idle_gap=Distribution.of(t.idle_before_seconds for t in later if t.idle_before_seconds is not None),
            waited_for_plan=Distribution.of(t.waited_for_plan_seconds for t in later
                                            if t.waited_for_plan_seconds is not None),
            plan_wait=Distribution.of(t.plan_wait_seconds for t in timings),
            plan_decode=Distribution.of(t.plan_decode_seconds for t in timings),
            result_encode=Distribution.of(t.result_encode_seconds for t in timings),
            rows=Distribution.of(float(t.rows) for t in timings))


@dataclass
class SchedulerStepTiming:
    """One step as the scheduler saw it, on its own clock."""
    step: int
    planning_seconds: float  # Scheduler.schedule() for this plan
    encode_seconds: float  # the plan turned into its message
    send_seconds: float  # the message written to every rank
    round_trip_seconds: float = 0.0  # plan sent -> result read
    # The round trip less the worker's plan-read -> execution-end interval: transport both ways,
    # the plan waiting in the worker's stream behind the step before it, the result's encoding.
    outside_worker_seconds: float = 0.0
    result_wait_seconds: float = 0.0  # the loop blocked reading the result (0: it waited for the loop)
    result_decode_seconds: float = 0.0
    result_handling_seconds: float = 0.0  # the result applied and routed, tokens flushed to detokenizers


class SchedulerTimeline:
    """The scheduler's stamps per step in flight."""

    def __init__(self) -> None:
        self._in_flight: dict[int, tuple[SchedulerStepTiming, float]] = {}  # step -> (timing, sent at)

    def sent(self, step: int, planning_seconds: float, encode_seconds: float, started: float,
             at: float) -> None:
        """Plan `step` (planned in `planning_seconds`, encoded in `encode_seconds`) was written from
        `started` until `at`."""
        self._in_flight[step] = (SchedulerStepTiming(step, planning_seconds, encode_seconds, at - started), at)

    def read(self, step: int, read_started: float, read_at: float, decoded_at: float,
             worker: WorkerStepTiming | None) -> SchedulerStepTiming | None:
        """Step `step`'s result, waited for from `read_started`, arrived at `read_at` and was
        decoded by `decoded_at`; `worker`: the worker's own account of it. None for a step this
        timeline never saw sent (a session that began before it)."""
        entry = self._in_flight.pop(step, None)
        if entry is None:
            return None
        timing, sent_at = entry
        timing.round_trip_seconds = read_at - sent_at
        if worker is not None:
            timing.outside_worker_seconds = max(0.0, timing.round_trip_seconds - worker.received_to_done_seconds)
        timing.result_wait_seconds = read_at - read_started
        timing.result_decode_seconds = decoded_at - read_at
        return timing

    def forget(self) -> None:
        """Every plan in flight was abandoned (the worker is gone)."""
        self._in_flight.clear()
