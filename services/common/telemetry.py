"""OpenTelemetry traces and GenAI server metrics, shared by every service (Prometheus metrics
are services/common/metrics.py).

Both are configured from the standard OTEL_* variables and exported over OTLP only when an
endpoint is set (OTEL_EXPORTER_OTLP_ENDPOINT, or the ..._TRACES_ / ..._METRICS_ one); otherwise
the API's no-op tracer and meter are used and cost next to nothing. Trace context crosses
services inside the messages that first introduce a request (W3C traceparent/tracestate).

The tracer and meter providers are OpenTelemetry's own process-wide globals, installed once per
process by ServiceShell (setup_tracing, setup_metrics) when the service starts; vmesh keeps no
state of its own about them: whether traces are exported is read back from the provider.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from vmesh.services.common.step_timeline import WorkerStepTiming
from vmesh.services.common.types import TraceContext

if TYPE_CHECKING:  # the SDK is imported only when something is exported
    from opentelemetry.sdk.resources import Resource

logger = logging.getLogger(__name__)

_PROPAGATOR = TraceContextTextMapPropagator()


def _otlp_endpoint(signal: str) -> str | None:
    """Where `signal` (traces, metrics) goes over OTLP, or None when it is not to be exported."""
    endpoint = (os.environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT")
                or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    disabled = os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true"
    if not endpoint or disabled or os.environ.get(f"OTEL_{signal.upper()}_EXPORTER", "otlp") == "none":
        return None
    return endpoint


def _resource(service: str) -> Resource:
    from opentelemetry.sdk.resources import Resource

    return Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", f"vmesh-{service}"),
                            "service.namespace": "vmesh", "vmesh.service": service})


def setup_tracing(service: str) -> bool:
    """Install an OTLP-exporting tracer provider if the environment asks for one."""
    if not (endpoint := _otlp_endpoint("traces")):
        return False
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=_resource(service))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    logger.info("exporting traces over OTLP to %s", endpoint)
    return True


def setup_metrics(service: str) -> bool:
    """Install an OTLP-exporting meter provider (every OTEL_METRIC_EXPORT_INTERVAL ms) if the
    environment asks for one."""
    if not (endpoint := _otlp_endpoint("metrics")):
        return False
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    reader = PeriodicExportingMetricReader(OTLPMetricExporter())
    metrics.set_meter_provider(MeterProvider(resource=_resource(service), metric_readers=[reader]))
    logger.info("exporting metrics over OTLP to %s", endpoint)
    return True


def tracing_enabled() -> bool:
    """A tracer provider that records spans is installed (the API's default only proxies to none)."""
    return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider | trace.NoOpTracerProvider)


def shutdown_tracing() -> None:
    """Flush what is batched, spans and metrics."""
    for provider in (trace.get_tracer_provider(), metrics.get_meter_provider()):
        if hasattr(provider, "shutdown"):
            provider.shutdown()


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def trace_context(span_context_holder: trace.Span | otel_context.Context | None = None) -> TraceContext:
    """The W3C context of a span (or of the current context)."""
    carrier: dict[str, str] = {}
    ctx = trace.set_span_in_context(span_context_holder) if isinstance(span_context_holder, trace.Span) \
        else span_context_holder
    _PROPAGATOR.inject(carrier, context=ctx)
    return TraceContext(traceparent=carrier.get("traceparent", ""), tracestate=carrier.get("tracestate", ""))


class W3CContext(Protocol):
    """A W3C trace context: the core TraceContext or the message field of the same name."""
    traceparent: str
    tracestate: str


def from_message(message: W3CContext) -> otel_context.Context | None:
    if not message.traceparent:
        return None
    carrier = {"traceparent": message.traceparent}
    if message.tracestate:
        carrier["tracestate"] = message.tracestate
    return _PROPAGATOR.extract(carrier)


def from_headers(headers: Mapping[str, str] | None) -> otel_context.Context | None:
    """The context a caller's W3C `traceparent` (and `tracestate`) names, from gRPC metadata or
    HTTP headers (keys in any case); None without one."""
    if not headers:
        return None
    carrier = {k.lower(): v for k, v in headers.items() if k.lower() in ("traceparent", "tracestate")}
    return _PROPAGATOR.extract(carrier) if "traceparent" in carrier else None


def span_context_of(message: W3CContext) -> trace.SpanContext | None:
    ctx = from_message(message)
    if ctx is None:
        return None
    span_context = trace.get_current_span(ctx).get_span_context()
    return span_context if span_context.is_valid else None


# OpenTelemetry's GenAI conventions for model servers: these names, units and buckets.
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                               7.5, 10.0)
TIME_PER_OUTPUT_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
REQUEST_DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96,
                            81.92)


class GenAIServerMetrics:
    """gen_ai.server.time_to_first_token, .time_per_output_token and .request.duration, as the
    frontend sees each request. Made from the global meter provider, they stay no-ops until
    setup_metrics installs one."""

    def __init__(self, meter_provider: metrics.MeterProvider | None = None):
        meter = metrics.get_meter("vmesh", meter_provider=meter_provider)
        self.time_to_first_token = meter.create_histogram(
            "gen_ai.server.time_to_first_token", unit="s",
            description="Time to generate first token for successful responses.",
            explicit_bucket_boundaries_advisory=TIME_TO_FIRST_TOKEN_BUCKETS)
        self.time_per_output_token = meter.create_histogram(
            "gen_ai.server.time_per_output_token", unit="s",
            description="Time per output token generated after the first token for successful responses.",
            explicit_bucket_boundaries_advisory=TIME_PER_OUTPUT_TOKEN_BUCKETS)
        self.request_duration = meter.create_histogram(
            "gen_ai.server.request.duration", unit="s",
            description="Generative AI server request duration such as time-to-last byte or last output token.",
            explicit_bucket_boundaries_advisory=REQUEST_DURATION_BUCKETS)

    def record(self, attributes: Mapping[str, str], started: float, first_token_at: float | None, ended: float,
               output_tokens: int, error_type: str | None = None) -> None:
        """One request's times (monotonic seconds). A failed request counts in the duration
        only, with `error.type`; the token times are for successful responses."""
        if error_type is not None:
            self.request_duration.record(ended - started, {**attributes, "error.type": error_type})
            return
        self.request_duration.record(ended - started, attributes)
        if first_token_at is not None:
            self.time_to_first_token.record(first_token_at - started, attributes)
            if output_tokens > 1:
                self.time_per_output_token.record((ended - first_token_at) / (output_tokens - 1), attributes)


# --- the step timeline on the worker's per-step span -------------------------------------------
# Intervals as attributes (seconds, `vmesh.step.*`), and the forward pass's bounds as events, so a
# trace viewer shows where inside the span the model ran and how long the worker waited before it.
STEP_ATTRIBUTE_PREFIX = "vmesh.step."
FORWARD_START_EVENT = "vmesh.forward.start"
FORWARD_END_EVENT = "vmesh.forward.end"
SAMPLING_END_EVENT = "vmesh.sampling.end"


def annotate_step(span: trace.Span, timing: WorkerStepTiming, ended: float, now: float) -> None:
    """Add `timing` to the step's span; `ended` (execution end) and `now` are perf_counter stamps,
    placed on the span's wall clock through the current offset between the two clocks."""
    if not span.is_recording():
        return
    intervals = {"plan_wait_s": timing.plan_wait_seconds, "plan_decode_s": timing.plan_decode_seconds,
                 "forward_s": timing.forward_seconds, "sampling_s": timing.sampling_seconds,
                 "idle_before_s": timing.idle_before_seconds, "waited_for_plan_s": timing.waited_for_plan_seconds}
    span.set_attributes({STEP_ATTRIBUTE_PREFIX + k: v for k, v in intervals.items() if v is not None})

    offset_ns = time.time_ns() - round(now * 1e9)  # read once: every event on the same offset

    def wall_ns(stamp: float) -> int:
        return offset_ns + round(stamp * 1e9)

    sampling_start = ended - timing.sampling_seconds
    span.add_event(FORWARD_START_EVENT, timestamp=wall_ns(sampling_start - timing.forward_seconds))
    span.add_event(FORWARD_END_EVENT, timestamp=wall_ns(sampling_start))
    span.add_event(SAMPLING_END_EVENT, timestamp=wall_ns(ended))
