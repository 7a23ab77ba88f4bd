"""A caller's W3C trace context, from gRPC metadata or HTTP headers, names the parent span."""

from __future__ import annotations

from opentelemetry import trace

from vmesh.services.common.telemetry import from_headers

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_traceparent_in_any_case_names_the_parent():
    for headers in ({"traceparent": TRACEPARENT}, {"Traceparent": TRACEPARENT, "TraceState": "k=v"}):
        parent = trace.get_current_span(from_headers(headers)).get_span_context()
        assert f"{parent.trace_id:032x}" == "0af7651916cd43dd8448eb211c80319c"
        assert f"{parent.span_id:016x}" == "b7ad6b7169203331"


def test_no_traceparent_no_parent():
    assert from_headers(None) is None
    assert from_headers({"authorization": "Bearer x"}) is None
