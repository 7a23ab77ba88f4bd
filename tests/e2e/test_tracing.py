"""One Generate call is one trace with spans from all four services, and the frontend's GenAI
server metrics, exported through the real OTLP exporters to an OTLP/gRPC receiver built on the
protocol's own service definitions."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent import futures

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from vmesh.services.bench.mesh import start_mesh
from vmesh.services.client import VmeshClient, generate_request


def service_name(resource) -> str:
    return next((a.value.string_value for a in resource.attributes if a.key == "service.name"), "")


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []  # (service.name, span)
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for resource_spans in request.resource_spans:
                service = service_name(resource_spans.resource)
                self.spans += [(service, span) for scope in resource_spans.scope_spans for span in scope.spans]
        return trace_service_pb2.ExportTraceServiceResponse()


class MetricsReceiver(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self) -> None:
        self.histograms: dict[tuple[str, str], list] = {}  # (service.name, metric) -> data points
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for resource_metrics in request.resource_metrics:
                service = service_name(resource_metrics.resource)
                for scope in resource_metrics.scope_metrics:
                    for metric in scope.metrics:
                        if metric.WhichOneof("data") == "histogram":
                            self.histograms[(service, metric.name)] = list(metric.histogram.data_points)
        return metrics_service_pb2.ExportMetricsServiceResponse()


def attributes(span) -> dict:
    out = {}
    for a in span.attributes:
        v = a.value
        kind = v.WhichOneof("value")  # by kind, so that a zero stays a zero
        out[a.key] = [x.string_value for x in v.array_value.values] if kind == "array_value" else getattr(v, kind)
    return out


CLIENT_TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
GENERATE = "chat SmolLM2-135M-Instruct"  # OpenTelemetry GenAI: "{operation} {model}"

def test_one_request_is_one_trace_across_all_services():
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    metrics_receiver = MetricsReceiver()
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(metrics_receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_EXPORTER_OTLP_INSECURE": "true",
           "OTEL_BSP_SCHEDULE_DELAY": "200", "OTEL_METRIC_EXPORT_INTERVAL": "300"}
    mesh = start_mesh(env=env)
    try:
        async def main():
            async with VmeshClient(mesh.address) as client:
                # The client's own trace (W3C traceparent in the call's metadata) is continued.
                request = generate_request(chat=[{"role": "user", "content": "Say hi."}], max_tokens=5,
                                           temperature=0, ignore_eos=True)
                outs = [o async for o in client.stub.Generate(request, metadata=(("traceparent", CLIENT_TRACE),))]
                return "", [t for o in outs for t in o.token_ids], outs[-1]

        _text, ids, last = asyncio.run(main())
        assert len(ids) == 5
        deadline = time.monotonic() + 30
        wanted = {"vmesh-frontend", "vmesh-scheduler", "vmesh-worker", "vmesh-detokenizer"}
        # Each service exports on its own schedule, and a span arrives only once it ends (the
        # scheduler's request span can end after the client has its last token): wait for all.
        wanted_names = {GENERATE, "scheduler.request", "scheduler.queue", "worker.step", "detokenizer.request"}
        while time.monotonic() < deadline:
            with receiver.lock:
                generate = [s for svc, s in receiver.spans if svc == "vmesh-frontend" and s.name == GENERATE]
                if generate:
                    trace_id = generate[0].trace_id
                    services = {svc for svc, s in receiver.spans if s.trace_id == trace_id}
                    names = {s.name for _svc, s in receiver.spans if s.trace_id == trace_id}
                    if wanted <= services and wanted_names <= names:
                        break
            time.sleep(0.2)
        assert generate, "no frontend span arrived"
        summary = sorted({(svc, s.name, s.trace_id.hex()[:8]) for svc, s in receiver.spans})
        assert wanted <= services, f"services in the trace: {services}; all spans: {summary}"
        assert generate[0].trace_id.hex() == CLIENT_TRACE.split("-")[1]  # the client's trace...
        assert generate[0].parent_span_id.hex() == CLIENT_TRACE.split("-")[2]  # ...under the client's span
        attrs = attributes(generate[0])
        assert attrs["gen_ai.operation.name"] == "chat" and attrs["gen_ai.provider.name"] == "vmesh"
        assert "gen_ai.system" not in attrs  # the deprecated name
        assert attrs["gen_ai.request.model"] == attrs["gen_ai.response.model"] == "SmolLM2-135M-Instruct"
        assert attrs["gen_ai.usage.cache_read.input_tokens"] == last.usage.cached_prompt_tokens
        assert attrs["gen_ai.usage.input_tokens"] == last.usage.prompt_tokens
        assert attrs["gen_ai.usage.output_tokens"] == 5
        assert attrs["gen_ai.response.finish_reasons"] == ["length"]
        assert wanted_names <= names, f"span names in the trace: {names}"
        steps = [s for _svc, s in receiver.spans if s.name == "worker.step" and s.trace_id == trace_id]
        assert all(any(link.trace_id == trace_id for link in s.links) for s in steps)
        # Health checks are not traced.
        assert not any("Health" in s.name for _svc, s in receiver.spans)

        # The frontend's GenAI server metrics, exported on their own schedule.
        wanted_metrics = {("vmesh-frontend", f"gen_ai.server.{name}")
                          for name in ("time_to_first_token", "time_per_output_token", "request.duration")}
        while time.monotonic() < deadline and not wanted_metrics <= set(metrics_receiver.histograms):
            time.sleep(0.2)
        with metrics_receiver.lock:
            for key in wanted_metrics:
                points = metrics_receiver.histograms.get(key)
                assert points, f"{key} not exported; got {sorted(metrics_receiver.histograms)}"
                chat = [p for p in points if attributes(p).get("gen_ai.operation.name") == "chat"]
                assert len(chat) == 1 and chat[0].count >= 1 and chat[0].sum > 0
                assert attributes(chat[0]) == {"gen_ai.operation.name": "chat", "gen_ai.provider.name": "vmesh",
                                               "gen_ai.request.model": "SmolLM2-135M-Instruct",
                                               "gen_ai.response.model": "SmolLM2-135M-Instruct"}
    finally:
        mesh.stop()
        server.stop(0)
