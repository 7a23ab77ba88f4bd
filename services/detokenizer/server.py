"""The detokenizer's gRPC shell. The scheduler streams each step's token ids for the requests
it routed here; this replica turns them into text and pushes the outputs down the owning
frontend's subscription. Stop-string hits go back to the scheduler on the same stream."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from opentelemetry import trace

from vmesh.services.common import telemetry, wire
from vmesh.services.common.grpc_server import ServiceShell
from vmesh.services.common.logprobs import TokenLogprobs, pack_logprobs, unpack_logprobs
from vmesh.services.common.metrics import DetokenizerMetrics
from vmesh.services.common.runtime.tasks import wait_until
from vmesh.services.detokenizer.incremental import IncrementalDetokenizer
from vmesh.v1 import common_pb2, detokenizer_pb2, detokenizer_pb2_grpc

logger = logging.getLogger(__name__)
TRACER = telemetry.tracer("vmesh.detokenizer")


@dataclass
class _Tracked:
    detokenizer: IncrementalDetokenizer
    frontend_id: str
    frontend_key: int
    num_prompt_tokens: int
    num_output_tokens: int = 0
    span: trace.Span = trace.INVALID_SPAN


@dataclass
class _SchedulerStream:
    """One scheduler's stream: its requests by stream handle (numbered per scheduler, and a
    request lives no longer than the stream that introduced it) and the replies waiting to go back."""
    requests: dict[int, _Tracked] = field(default_factory=dict)
    replies: asyncio.Queue[detokenizer_pb2.DetokenizeResponse | None] = field(default_factory=asyncio.Queue)


class _FrontendBatch:
    """Columns of one SubscribeResponse under construction."""

    def __init__(self) -> None:
        self.pb = detokenizer_pb2.SubscribeResponse()

    def add(self, frontend_key: int, text: str, token_ids: list[int], reason: int, tracked: _Tracked, cached: int,
            logprobs: list[TokenLogprobs], error: str, resumable: bool = False) -> None:
        pb = self.pb
        pb.errors.append(error)
        pb.resumable.append(resumable)
        pb.frontend_keys.append(frontend_key)
        pb.texts.append(text)
        pb.num_tokens.append(len(token_ids))
        pb.token_ids.extend(token_ids)
        pb.finish_reasons.append(reason)
        pb.num_prompt_tokens.append(tracked.num_prompt_tokens)
        pb.num_output_tokens.append(tracked.num_output_tokens)
        pb.num_cached_prompt_tokens.append(cached)
        pb.num_logprobs_rows.append(len(logprobs))
        pack_logprobs(logprobs, pb.logprobs)


class DetokenizerServicer(detokenizer_pb2_grpc.DetokenizerServiceServicer):
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.streams: list[_SchedulerStream] = []
        self.draining = False
        self.subscribers: dict[str, asyncio.Queue[detokenizer_pb2.SubscribeResponse]] = {}
        self.metrics: DetokenizerMetrics | None = None

    async def Subscribe(self, request, context):
        queue: asyncio.Queue = asyncio.Queue()
        self.subscribers[request.frontend_id] = queue
        logger.info("frontend %s subscribed", request.frontend_id)
        await context.send_initial_metadata(())  # tells the frontend it is registered
        try:
            while True:
                yield await queue.get()
        finally:
            if self.subscribers.get(request.frontend_id) is queue:  # and no newer subscription replaced it
                del self.subscribers[request.frontend_id]
                self._orphan(request.frontend_id)

    def _orphan(self, frontend_id: str) -> None:
        """Drop a gone frontend's requests and ask their schedulers to stop computing them."""
        for stream in self.streams:
            handles = [h for h, tracked in stream.requests.items() if tracked.frontend_id == frontend_id]
            for handle in handles:
                stream.requests.pop(handle).span.end()
            if handles:
                logger.warning("frontend %s went away; stopping its %d request(s)", frontend_id, len(handles))
                stream.replies.put_nowait(detokenizer_pb2.DetokenizeResponse(orphaned_handles=handles))

    @property
    def num_requests(self) -> int:
        return sum(len(stream.requests) for stream in self.streams)

    def start_draining(self) -> None:
        """Shutting down: ask every scheduler to route no new requests here."""
        self.draining = True
        for stream in self.streams:
            stream.replies.put_nowait(detokenizer_pb2.DetokenizeResponse(draining=True))

    async def Detokenize(self, request_iterator, context):
        stream = _SchedulerStream()
        self.streams.append(stream)
        if self.draining:
            stream.replies.put_nowait(detokenizer_pb2.DetokenizeResponse(draining=True))
        await context.send_initial_metadata(())  # tells the scheduler the stream is open
        consumer = asyncio.create_task(self._consume(request_iterator, stream))
        try:
            while (reply := await stream.replies.get()) is not None:
                yield reply
            consumer.result()  # the scheduler's side ended: with its error, if any
        finally:
            consumer.cancel()
            self.streams.remove(stream)
            if stream.requests:  # the scheduler went away mid-request: nothing more will come for these
                self.fail(stream.requests, "the scheduler's stream to this detokenizer closed", resumable=True)

    async def _consume(self, request_iterator, stream: _SchedulerStream) -> None:
        try:
            async for batch in request_iterator:
                reply = self.process(batch, stream.requests)
                if reply.stopped_handles or reply.orphaned_handles:
                    stream.replies.put_nowait(reply)
        finally:
            stream.replies.put_nowait(None)

    def fail(self, requests: dict[int, _Tracked], error: str, resumable: bool = False) -> None:
        """End `requests` with `error`; `resumable`: their frontends may submit them again."""
        logger.error("%s; failing %d request(s)", error, len(requests))
        out: dict[str, _FrontendBatch] = {}
        for tracked in requests.values():
            tracked.span.end()
            out.setdefault(tracked.frontend_id, _FrontendBatch()).add(
                tracked.frontend_key, "", [], common_pb2.FINISH_REASON_ABORT, tracked, 0, [], error, resumable)
        requests.clear()
        self._publish(out)

    def process(self, batch: detokenizer_pb2.DetokenizeRequest,
                requests: dict[int, _Tracked]) -> detokenizer_pb2.DetokenizeResponse:
        """Decode one step's tokens and publish the outputs; the reply names the requests to stop:
        a stop string matched, or their frontend is gone."""
        orphaned = []
        for info in batch.new_requests:
            if info.frontend_id not in self.subscribers:
                # Frontends subscribe before they submit: this one has gone (its subscription
                # ended while the request was still queued, so `_orphan` could not name it).
                orphaned.append(info.handle)
                continue
            params = wire.sampling_from_proto(info.sampling)
            detokenizer = IncrementalDetokenizer(self.tokenizer, params, list(info.prompt_tail))
            if info.resumed_output_token_ids:
                detokenizer.resume(list(info.resumed_output_token_ids), info.resumed_text_length)
            requests[info.handle] = _Tracked(
                detokenizer, info.frontend_id, info.frontend_key, info.num_prompt_tokens,
                num_output_tokens=len(info.resumed_output_token_ids),
                span=TRACER.start_span("detokenizer.request", context=telemetry.from_proto(info.trace_context))
                if telemetry.tracing_enabled() else trace.INVALID_SPAN)
        logprobs = _logprobs_by_handle(batch)
        out: dict[str, _FrontendBatch] = {}
        stopped = []
        offset = 0
        for i, handle in enumerate(batch.handles):
            n = batch.num_tokens[i]
            token_ids = list(batch.token_ids[offset:offset + n])
            offset += n
            tracked = requests.get(handle)
            if tracked is None:
                continue
            reason = batch.finish_reasons[i]
            finished = reason != common_pb2.FINISH_REASON_UNSPECIFIED
            tracked.num_output_tokens += n
            result = tracked.detokenizer.update(token_ids, finished)
            if result.stop_hit and not finished:
                reason = common_pb2.FINISH_REASON_STOP
                stopped.append(handle)
                if self.metrics:
                    self.metrics.stop_string_hits.inc()
            if result.finished:
                del requests[handle]
                tracked.span.set_attribute("vmesh.output_tokens", tracked.num_output_tokens)
                tracked.span.end()
            if not result.text and not token_ids and not result.finished:
                continue
            out.setdefault(tracked.frontend_id, _FrontendBatch()).add(
                tracked.frontend_key, result.text, token_ids, reason, tracked,
                batch.num_cached_prompt_tokens[i], logprobs.get(handle, []), batch.errors[i] if batch.errors else "")
        if self.metrics:
            self.metrics.tokens.inc(sum(batch.num_tokens))
        self._publish(out)
        if orphaned:
            logger.warning("%d new request(s) of frontends that went away; stopping them", len(orphaned))
        return detokenizer_pb2.DetokenizeResponse(stopped_handles=stopped, orphaned_handles=orphaned)

    def _publish(self, out: dict[str, _FrontendBatch]) -> None:
        for frontend_id, frontend_batch in out.items():
            queue = self.subscribers.get(frontend_id)
            if queue is None:
                logger.warning("no subscription from frontend %s; dropping its outputs", frontend_id)
                continue
            queue.put_nowait(frontend_batch.pb)


def _logprobs_by_handle(batch: detokenizer_pb2.DetokenizeRequest) -> dict[int, list[TokenLogprobs]]:
    by_handle: dict[int, list[TokenLogprobs]] = {}
    for handle, row in zip(batch.logprobs_handles, unpack_logprobs(batch.logprobs)):
        by_handle.setdefault(handle, []).append(row)
    return by_handle


async def serve(load_tokenizer, host: str, port: int, ready_file: str | None,
                metrics_port: int | None = None, model_name: str = "") -> None:
    """`model_name`: the model whose tokenizer it loads, the label on its metrics."""
    shell = ServiceShell("detokenizer", detokenizer_pb2.DESCRIPTOR.services_by_name["DetokenizerService"], host, port)
    servicer = DetokenizerServicer(None)
    detokenizer_pb2_grpc.add_DetokenizerServiceServicer_to_server(servicer, shell.server)
    if registry := shell.metrics_registry(metrics_port, ready_file):
        servicer.metrics = DetokenizerMetrics(registry, model_name)

    async def warm_up() -> None:
        servicer.tokenizer = await asyncio.get_running_loop().run_in_executor(None, load_tokenizer)

    async def drain() -> None:
        servicer.start_draining()
        await wait_until(lambda: not servicer.num_requests)

    await shell.run(warm_up, drain, ready_file)
