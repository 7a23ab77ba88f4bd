"""The GenAI model-server metrics as OpenTelemetry's conventions name and bucket them."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from vmesh.services.common.telemetry import (
    REQUEST_DURATION_BUCKETS,
    TIME_PER_OUTPUT_TOKEN_BUCKETS,
    TIME_TO_FIRST_TOKEN_BUCKETS,
    GenAIServerMetrics,
)

ATTRIBUTES = {"gen_ai.operation.name": "chat", "gen_ai.provider.name": "vmesh", "gen_ai.request.model": "m"}


def exported(reader: InMemoryMetricReader) -> dict[str, list]:
    data = reader.get_metrics_data()
    return {m.name: (m.unit, m.data.data_points) for rm in data.resource_metrics for sm in rm.scope_metrics
            for m in sm.metrics}


@pytest.fixture
def recorder_and_reader():
    reader = InMemoryMetricReader()
    return GenAIServerMetrics(MeterProvider(metric_readers=[reader])), reader


def test_a_successful_request_records_all_three(recorder_and_reader):
    recorder, reader = recorder_and_reader
    # 0.25 s to the first token, then 4 more tokens over 0.4 s: 0.1 s per output token.
    recorder.record(ATTRIBUTES, started=10.0, first_token_at=10.25, ended=10.65, output_tokens=5)
    metrics = exported(reader)
    buckets = {"gen_ai.server.time_to_first_token": (TIME_TO_FIRST_TOKEN_BUCKETS, 0.25),
               "gen_ai.server.time_per_output_token": (TIME_PER_OUTPUT_TOKEN_BUCKETS, 0.1),
               "gen_ai.server.request.duration": (REQUEST_DURATION_BUCKETS, 0.65)}
    assert set(metrics) == set(buckets)
    for name, (bounds, value) in buckets.items():
        unit, points = metrics[name]
        assert unit == "s" and len(points) == 1
        assert tuple(points[0].explicit_bounds) == bounds
        assert points[0].count == 1 and points[0].sum == pytest.approx(value)
        assert dict(points[0].attributes) == ATTRIBUTES


def test_a_failed_request_counts_in_the_duration_only_with_its_error_type(recorder_and_reader):
    recorder, reader = recorder_and_reader
    recorder.record(ATTRIBUTES, started=1.0, first_token_at=1.5, ended=2.0, output_tokens=0,
                    error_type="UNAVAILABLE")
    metrics = exported(reader)
    assert set(metrics) == {"gen_ai.server.request.duration"}
    (point,) = metrics["gen_ai.server.request.duration"][1]
    assert dict(point.attributes) == {**ATTRIBUTES, "error.type": "UNAVAILABLE"}
    assert point.sum == pytest.approx(1.0)


def test_one_token_has_no_time_per_output_token(recorder_and_reader):
    recorder, reader = recorder_and_reader
    recorder.record(ATTRIBUTES, started=0.0, first_token_at=0.1, ended=0.1, output_tokens=1)
    assert set(exported(reader)) == {"gen_ai.server.time_to_first_token", "gen_ai.server.request.duration"}
