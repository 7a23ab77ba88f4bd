"""Prometheus metrics, named as vLLM names them under a `vmesh:` prefix, so that vLLM
dashboards need only a prefix change. Durations come from one process's monotonic clock.

Gauges and counters the cores already keep (queue lengths, KV usage, prefix-cache counts)
are read at scrape time by collectors, so the hot path pays nothing for them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                   20.0, 40.0, 80.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def serve_metrics(registry: CollectorRegistry, host: str, port: int | None, ready_file: str | None) -> str | None:
    """Expose `registry` at http://host:port/metrics (port 0: any free port); None disables.
    The bound address is written to `<ready_file>.metrics` for launchers.

    Always the classic text format: prometheus_client's OpenMetrics output rewrites the
    colons of `vmesh:` names to underscores, and Prometheus asks for OpenMetrics first."""
    if port is None or port < 0:
        return None

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?")[0] not in ("/metrics", "/"):
                self.send_error(404)
                return
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:  # scrapes are not worth a log line each
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="vmesh-metrics", daemon=True).start()
    address = f"{host}:{server.server_port}"
    if ready_file:
        Path(ready_file + ".metrics").write_text(address)
    return address


class Gauges(Collector):
    """Gauges and counters computed at scrape time from a snapshot function."""

    def __init__(self, snapshot: Callable[[], dict[str, tuple[str, str, float]]]):
        self.snapshot = snapshot  # name -> (kind "gauge"|"counter", help, value)

    def collect(self):
        for name, (kind, help_text, value) in self.snapshot().items():
            family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            metric = family(name, help_text)
            metric.add_metric([], value)
            yield metric


class FrontendMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.ttft = Histogram("vmesh:time_to_first_token_seconds", "Time to first token.",
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram("vmesh:inter_token_latency_seconds", "Time between output tokens.",
                             buckets=LATENCY_BUCKETS, registry=registry)
        self.e2e = Histogram("vmesh:e2e_request_latency_seconds", "End-to-end request latency.",
                             buckets=LATENCY_BUCKETS, registry=registry)
        self.requests = Counter("vmesh:request_success", "Finished requests by reason.", ["finished_reason"],
                                registry=registry)
        self.prompt_tokens = Counter("vmesh:prompt_tokens", "Prompt tokens received.", registry=registry)
        self.generation_tokens = Counter("vmesh:generation_tokens", "Tokens streamed to clients.", registry=registry)


class SchedulerMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.queue_time = Histogram("vmesh:request_queue_time_seconds", "Time from submission to first admission.",
                                    buckets=LATENCY_BUCKETS, registry=registry)
        self.prompt_tokens = Counter("vmesh:prompt_tokens", "Prompt tokens admitted.", registry=registry)
        self.generation_tokens = Counter("vmesh:generation_tokens", "Tokens generated.", registry=registry)


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.step_time = Histogram("vmesh:worker_step_seconds", "Forward + sampling time per step.",
                                   buckets=STEP_BUCKETS, registry=registry)
        self.batch_size = Histogram("vmesh:worker_batch_size", "Requests per step.", buckets=BATCH_BUCKETS,
                                    registry=registry)
        self.scheduled_tokens = Counter("vmesh:worker_scheduled_tokens", "Tokens computed.", registry=registry)


class DetokenizerMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.tokens = Counter("vmesh:detokenizer_tokens", "Token ids turned into text.", registry=registry)
        self.stop_string_hits = Counter("vmesh:detokenizer_stop_string_hits", "Requests ended by a stop string.",
                                        registry=registry)
