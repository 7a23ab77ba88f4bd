"""OpenTelemetry tracing and Prometheus metrics, shared by every service.

Tracing is configured from the standard OTEL_* variables: spans are exported over OTLP only
when an endpoint is set (OTEL_EXPORTER_OTLP_ENDPOINT or ..._TRACES_ENDPOINT); otherwise the
API's no-op tracer is used and costs next to nothing. Trace context crosses services inside
the messages that first introduce a request (W3C traceparent/tracestate).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from vmesh.v1 import common_pb2

logger = logging.getLogger(__name__)

_PROPAGATOR = TraceContextTextMapPropagator()
_enabled = False


def setup_tracing(service: str) -> bool:
    """Install an OTLP-exporting tracer provider if the environment asks for one."""
    global _enabled
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    disabled = os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true"
    if not endpoint or disabled or os.environ.get("OTEL_TRACES_EXPORTER", "otlp") == "none":
        return False
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", f"vmesh-{service}"),
                                "service.namespace": "vmesh", "vmesh.service": service})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _enabled = True
    logger.info("exporting traces over OTLP to %s", endpoint)
    return True


def tracing_enabled() -> bool:
    return _enabled


def shutdown_tracing() -> None:
    provider = trace.get_tracer_provider()
    if hasattr(provider, "shutdown"):
        provider.shutdown()  # flushes what is batched


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def to_proto(span_context_holder: trace.Span | otel_context.Context | None = None) -> common_pb2.TraceContext:
    """The W3C context of a span (or of the current context) as a message field."""
    carrier: dict[str, str] = {}
    ctx = trace.set_span_in_context(span_context_holder) if isinstance(span_context_holder, trace.Span) \
        else span_context_holder
    _PROPAGATOR.inject(carrier, context=ctx)
    return common_pb2.TraceContext(traceparent=carrier.get("traceparent", ""),
                                   tracestate=carrier.get("tracestate", ""))


def from_proto(message: common_pb2.TraceContext) -> otel_context.Context | None:
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


def span_context_of(message: common_pb2.TraceContext) -> trace.SpanContext | None:
    ctx = from_proto(message)
    if ctx is None:
        return None
    span_context = trace.get_current_span(ctx).get_span_context()
    return span_context if span_context.is_valid else None
