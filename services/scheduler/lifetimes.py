"""Each routed request's life in the scheduler, from submission to its end: its trace spans
("scheduler.request", and "scheduler.queue" until its first admission) and vLLM's request
metrics (queue, prefill, decode and inference time; prompt and generation tokens)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from opentelemetry import context as otel_context
from opentelemetry import trace

from vmesh.services.common import telemetry
from vmesh.services.common.metrics import SchedulerMetrics
from vmesh.services.scheduler.scheduler import RequestUpdate

TRACER = telemetry.tracer("vmesh.scheduler")


@dataclass
class Lifetime:
    """A request's life in the scheduler, for its trace and vLLM's request histograms."""
    num_prompt_tokens: int
    submitted_at: float = 0.0  # monotonic
    admitted_at: float = 0.0  # first admission (monotonic); for the request histograms
    first_token_at: float = 0.0  # 0: no token yet
    num_generated: int = 0
    span: trace.Span = trace.INVALID_SPAN  # the request's life in the scheduler
    queue_span: trace.Span | None = None  # from submission to first admission
    worker_losses: int = 0  # times the worker was lost while computing it
    num_draft_tokens: int = 0  # speculative decoding: drafts verified for it, and those accepted
    num_accepted_tokens: int = 0


class Lifetimes:
    """The lifetimes of the requests the detokenizer router has a route for, by request key."""

    def __init__(self) -> None:
        self.by_key: dict[str, Lifetime] = {}
        # Created once the workers answered: every series carries the model's name, as vLLM's do.
        self.metrics: SchedulerMetrics | None = None

    def get(self, key: str) -> Lifetime | None:
        return self.by_key.get(key)

    def begin(self, key: str, num_prompt_tokens: int, parent: otel_context.Context | None,
              attributes: Mapping[str, str | int]) -> Lifetime:
        """A request was submitted: its spans start, as a child of the caller's trace `parent`."""
        life = self.by_key[key] = Lifetime(num_prompt_tokens, submitted_at=time.monotonic())
        life.span = TRACER.start_span("scheduler.request", context=parent, attributes=attributes)
        life.queue_span = TRACER.start_span("scheduler.queue", context=trace.set_span_in_context(life.span))
        return life

    def admitted(self, key: str) -> Lifetime | None:
        """The request enters the worker's batch (again, after a preemption or a lost worker)."""
        life = self.by_key.get(key)
        if life is None or life.queue_span is None:  # not routed, or admitted before
            return life
        life.queue_span.end()
        life.queue_span = None
        life.admitted_at = time.monotonic()
        if self.metrics:
            self.metrics.queue_time.observe(life.admitted_at - life.submitted_at)
            self.metrics.prompt_tokens.inc(life.num_prompt_tokens)
        return life

    def stepped(self, updates: list[RequestUpdate], now: float) -> None:
        """One step's results: tokens counted, and the requests the engine finished ended (with
        vLLM's per-request histograms, which requests aborted from outside do not get)."""
        generated = 0
        for update in updates:
            life = self.by_key.get(update.request_id)
            if life is None:  # not routed: nobody waits for it
                continue
            life.num_draft_tokens += update.num_draft_tokens
            life.num_accepted_tokens += update.num_accepted_tokens
            if num_new := len(update.new_token_ids):
                generated += num_new
                life.num_generated += num_new
                if not life.first_token_at:
                    life.first_token_at = now
            if update.finish_reason is not None:
                self.end(update.request_id, update.finish_reason.value)
                if self.metrics:
                    self._observe_finished(self.metrics, life, now)
        if self.metrics and generated:
            self.metrics.generation_tokens.inc(generated)

    def end(self, key: str, finish_reason: str) -> None:
        """The request's spans end; nothing if it has none (ended already)."""
        if (life := self.by_key.pop(key, None)) is not None:
            if life.queue_span is not None:
                life.queue_span.end()
            life.span.set_attribute("vmesh.finish_reason", finish_reason)
            if life.num_draft_tokens:  # the request's acceptance, on its trace
                life.span.set_attribute("vmesh.spec_decode.num_draft_tokens", life.num_draft_tokens)
                life.span.set_attribute("vmesh.spec_decode.num_accepted_tokens", life.num_accepted_tokens)
            life.span.end()

    @staticmethod
    def _observe_finished(m: SchedulerMetrics, life: Lifetime, now: float) -> None:
        m.request_prompt_tokens.observe(life.num_prompt_tokens)
        m.request_generation_tokens.observe(life.num_generated)
        m.inference_time.observe(now - life.admitted_at)
        if life.first_token_at:  # a request can end without a token (e.g. an engine-side abort)
            m.prefill_time.observe(life.first_token_at - life.admitted_at)
            m.decode_time.observe(now - life.first_token_at)
