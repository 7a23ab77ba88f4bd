"""Prometheus metrics, named as vLLM names them under a `vmesh:` prefix, so that vLLM
dashboards need only a prefix change. Durations come from one process's monotonic clock.

Gauges and counters the cores already keep (queue lengths, KV usage, prefix-cache counts)
are read at scrape time by collectors, so the hot path pays nothing for them.

Every series carries a `model_name` label, as vLLM's do: its Grafana dashboard filters every
query on it. Each series is exported by exactly one service, so a sum over all of them counts
once: token counters and request histograms by the scheduler (the engine, as in vLLM), client-
side latencies and request outcomes by the frontend.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from vmesh.services.common.runtime.readiness import Announcement, announce

# Otherwise every counter and histogram also exports a `_created` series, which vLLM does not
# (it disables them too) and which dashboards summing `{__name__=~...}` would pick up.
disable_created_metrics()

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                   20.0, 40.0, 80.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)
# The intervals between and around steps: tens of microseconds when the pipeline is full, up to a
# step's length when the worker waits for its plan, seconds when it has nothing to do.
GAP_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
               5.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
MODEL = ["model_name"]


def token_buckets(max_value: int) -> list[int]:
    """vLLM's 1-2-5 series up to `max_value` (its request_prompt/generation_tokens buckets)."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10 ** exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


def iteration_buckets(max_tokens: int) -> list[int]:
    """Powers of two up to a step's token budget: decode steps (a few tokens) and full prefill
    chunks both land in a bucket of their own."""
    buckets = [1]
    while buckets[-1] < max_tokens:
        buckets.append(buckets[-1] * 2)
    return buckets


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
    announce(ready_file, Announcement.METRICS, address)
    return address


class ScrapedMetrics(Collector):
    """Gauges and counters computed at scrape time from a snapshot function."""

    def __init__(self, snapshot: Callable[[], dict[str, tuple[str, str, float]]], model_name: str):
        self.snapshot = snapshot  # name -> (kind "gauge"|"counter", help, value)
        self.model_name = model_name

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        for name, (kind, help_text, value) in self.snapshot().items():
            family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            metric = family(name, help_text, labels=MODEL)
            metric.add_metric([self.model_name], value)
            yield metric


class FrontendMetrics:
    """What clients see. Token counts are the scheduler's: counting them here too would make
    every sum across services count them twice."""

    def __init__(self, registry: CollectorRegistry, model_name: str, failover_kinds: Sequence[str] = ()):
        """`failover_kinds`: the services a request can fail over from, exported at 0 from the
        start, so that a healthy mesh already has the series an alert watches."""
        self.model_name = model_name
        self.ttft = Histogram("vmesh:time_to_first_token_seconds", "Time to first token.", MODEL,
                              buckets=LATENCY_BUCKETS, registry=registry).labels(model_name)
        self.itl = Histogram("vmesh:inter_token_latency_seconds", "Time between output tokens.", MODEL,
                             buckets=LATENCY_BUCKETS, registry=registry).labels(model_name)
        self.e2e = Histogram("vmesh:e2e_request_latency_seconds", "End-to-end request latency.", MODEL,
                             buckets=LATENCY_BUCKETS, registry=registry).labels(model_name)
        self._requests = Counter("vmesh:request_success", "Finished requests by reason.",
                                 [*MODEL, "finished_reason"], registry=registry)

        self._failovers = Counter("vmesh:request_failovers", "Requests resubmitted after losing their scheduler "
                                  "or detokenizer replica, by the service lost.", [*MODEL, "kind"], registry=registry)
        for kind in failover_kinds:
            self._failovers.labels(model_name, kind)

    def request_finished(self, reason: str) -> None:
        self._requests.labels(self.model_name, reason).inc()

    def failover(self, kind: str) -> None:
        self._failovers.labels(self.model_name, kind).inc()


class SchedulerMetrics:
    """The engine's series, created once the workers have said which model they serve (and its
    length, which bounds the token buckets)."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int,
                 max_num_batched_tokens: int):
        def histogram(name: str, help_text: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, help_text, MODEL, buckets=buckets, registry=registry).labels(model_name)

        def counter(name: str, help_text: str) -> Counter:
            return Counter(name, help_text, MODEL, registry=registry).labels(model_name)

        self.queue_time = histogram("vmesh:request_queue_time_seconds", "Time from submission to first admission.",
                                    LATENCY_BUCKETS)
        self.prefill_time = histogram("vmesh:request_prefill_time_seconds",
                                      "Time from first admission to first token.", LATENCY_BUCKETS)
        self.decode_time = histogram("vmesh:request_decode_time_seconds", "Time from first token to finish.",
                                     LATENCY_BUCKETS)
        self.inference_time = histogram("vmesh:request_inference_time_seconds",
                                        "Time from first admission to finish.", LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("vmesh:request_prompt_tokens", "Prompt tokens per finished request.",
                                               token_buckets(max_model_len))
        self.request_generation_tokens = histogram("vmesh:request_generation_tokens",
                                                   "Generated tokens per finished request.",
                                                   token_buckets(max_model_len))
        self.iteration_tokens = histogram("vmesh:iteration_tokens_total", "Tokens scheduled per step.",
                                          iteration_buckets(max_num_batched_tokens))
        self.prompt_tokens = counter("vmesh:prompt_tokens", "Prompt tokens admitted.")
        self.generation_tokens = counter("vmesh:generation_tokens", "Tokens generated.")
        self.step = SchedulerStepMetrics(histogram)


class SchedulerStepMetrics:
    """The scheduler's side of the step timeline (services/common/step_timeline.py)."""

    def __init__(self, histogram: Callable[[str, str, Sequence[float]], Histogram]):
        self.planning = histogram("vmesh:scheduler_planning_seconds", "Time to plan one step.", GAP_BUCKETS)
        self.plan_encode = histogram("vmesh:scheduler_plan_encode_seconds",
                                     "Time to turn a plan into its message and write it to the worker ranks.",
                                     GAP_BUCKETS)
        self.round_trip = histogram("vmesh:scheduler_step_round_trip_seconds",
                                    "Plan sent to its result read, on the scheduler's clock.", STEP_BUCKETS)
        self.outside_worker = histogram(
            "vmesh:scheduler_step_outside_worker_seconds",
            "A step's round trip less the worker's plan-read to execution-end interval: transport, the plan "
            "queued behind the step before it, the result's encoding.", GAP_BUCKETS)
        self.result_wait = histogram("vmesh:scheduler_result_wait_seconds",
                                     "Time the engine loop blocked on a step's result (near 0: the result "
                                     "waited for the loop).", GAP_BUCKETS)
        self.result_handling = histogram("vmesh:scheduler_result_handling_seconds",
                                         "Time to decode, apply and route a step's result.", GAP_BUCKETS)


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str):
        self.step_time = Histogram("vmesh:worker_step_seconds", "Forward + sampling time per step.", MODEL,
                                   buckets=STEP_BUCKETS, registry=registry).labels(model_name)
        self.batch_size = Histogram("vmesh:worker_batch_size", "Requests per step.", MODEL, buckets=BATCH_BUCKETS,
                                    registry=registry).labels(model_name)
        self.scheduled_tokens = Counter("vmesh:worker_scheduled_tokens", "Tokens computed.", MODEL,
                                        registry=registry).labels(model_name)

        def gap(name: str, help_text: str) -> Histogram:
            return Histogram(name, help_text, MODEL, buckets=GAP_BUCKETS, registry=registry).labels(model_name)

        # The worker's side of the step timeline (services/common/step_timeline.py).
        self.idle_gap = gap("vmesh:worker_idle_gap_seconds",
                            "Time the model thread stood idle between the end of one step and the start of the next.")
        self.waited_for_plan = gap("vmesh:worker_waited_for_plan_seconds",
                                   "Time from a result handed to the transport to the next plan read.")
        self.plan_wait = gap("vmesh:worker_plan_wait_seconds", "Time from a plan read to its execution's start.")
        self.plan_decode = gap("vmesh:worker_plan_decode_seconds", "Time to turn a plan message into a plan.")
        self.result_encode = gap("vmesh:worker_result_encode_seconds",
                                 "Time to turn a result into its message and hand it to the transport.")


class DetokenizerMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str):
        self.tokens = Counter("vmesh:detokenizer_tokens", "Token ids turned into text.", MODEL,
                              registry=registry).labels(model_name)
        self.stop_string_hits = Counter("vmesh:detokenizer_stop_string_hits", "Requests ended by a stop string.",
                                        MODEL, registry=registry).labels(model_name)
