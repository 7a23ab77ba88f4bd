"""The detokenizer's gRPC shell. The scheduler streams each step's token ids for the requests
it routed here; this replica turns them into text and pushes the outputs down the owning
frontend's subscription. Stop-string hits go back to the scheduler on the same stream."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import grpc
from opentelemetry import trace

from vmesh.services.common import telemetry
from vmesh.services.common.grpc_server import ServiceShell
from vmesh.services.common.metrics import DetokenizerMetrics
from vmesh.services.common.runtime.tasks import wait_until
from vmesh.services.common.server_settings import ServerSettings
from vmesh.services.common.types import FinishReason, OutputBatch, StreamOutput, TokenBatch, TokenLogprobs
from vmesh.services.common.wire import outputs, tokens
from vmesh.services.detokenizer.output_processor import OutputProcessor, RequestState
from vmesh.v1 import detokenizer_pb2, detokenizer_pb2_grpc

logger = logging.getLogger(__name__)
TRACER = telemetry.tracer("vmesh.detokenizer")


@dataclass
class _SchedulerStream:
    """One scheduler's stream: its requests by stream handle (numbered per scheduler, and a
    request lives no longer than the stream that introduced it) and the replies waiting to go back."""
    requests: OutputProcessor[int]
    replies: asyncio.Queue[detokenizer_pb2.DetokenizeResponse | None] = field(default_factory=asyncio.Queue)


def _output(state: RequestState, text: str, token_ids: list[int], reason: FinishReason | None, cached: int,
            logprobs: list[TokenLogprobs], error: str = "", resumable: bool = False,
            prompt_logprobs: list[TokenLogprobs] | None = None, embedding: list[float] | None = None) -> StreamOutput:
    assert state.ref is not None, "every request here was introduced by its frontend's reference"
    return StreamOutput(state.ref.frontend_key, text, token_ids, reason, state.num_prompt_tokens,
                        state.num_output_tokens, cached, logprobs, error, resumable, prompt_logprobs or [],
                        embedding or [])


class DetokenizerServicer(detokenizer_pb2_grpc.DetokenizerServiceServicer):
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.streams: list[_SchedulerStream] = []
        self.draining = False
        # Per frontend id, its subscription's queue; None in it ends that subscription (a newer one took over).
        self.subscribers: dict[str, asyncio.Queue[detokenizer_pb2.SubscribeResponse | None]] = {}
        self.metrics: DetokenizerMetrics | None = None

    async def Subscribe(self, request, context):
        queue: asyncio.Queue[detokenizer_pb2.SubscribeResponse | None] = asyncio.Queue()
        if (displaced := self.subscribers.get(request.frontend_id)) is not None:
            # The newest subscription under an id wins, and the one it displaces is ended at once
            # rather than starved: when that one was the rightful frontend's (and the newcomer a
            # stranger, or a stale stream of its own), the frontend's reconnect loop takes the id
            # back within its backoff, and its requests fail over losslessly meanwhile.
            logger.warning("a new subscription under frontend id %s displaces the previous one", request.frontend_id)
            displaced.put_nowait(None)
        self.subscribers[request.frontend_id] = queue
        logger.info("frontend %s subscribed", request.frontend_id)
        await context.send_initial_metadata(())  # tells the frontend it is registered
        try:
            while (batch := await queue.get()) is not None:
                yield batch
            await context.abort(grpc.StatusCode.ABORTED, "a newer subscription under this frontend id took over")
        finally:
            if self.subscribers.get(request.frontend_id) is queue:  # and no newer subscription replaced it
                del self.subscribers[request.frontend_id]
                self._orphan(request.frontend_id)

    def _orphan(self, frontend_id: str) -> None:
        """Drop a gone frontend's requests and ask their schedulers to stop computing them."""
        for stream in self.streams:
            handles = [h for h, state in stream.requests.items()
                       if state.ref is not None and state.ref.frontend_id == frontend_id]
            for handle in handles:
                if (state := stream.requests.pop(handle)) is not None:
                    state.span.end()
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
        stream = _SchedulerStream(OutputProcessor(self.tokenizer))
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

    def fail(self, requests: OutputProcessor[int], error: str, resumable: bool = False) -> None:
        """End `requests` with `error`; `resumable`: their frontends may submit them again."""
        logger.error("%s; failing %d request(s)", error, len(requests))
        out: dict[str, OutputBatch] = {}
        for _, state in requests.items():
            state.span.end()
            assert state.ref is not None
            out.setdefault(state.ref.frontend_id, OutputBatch()).outputs.append(
                _output(state, "", [], FinishReason.ABORT, 0, [], error, resumable))
        requests.requests.clear()
        self._publish(out)

    def process(self, message: detokenizer_pb2.DetokenizeRequest,
                requests: OutputProcessor[int]) -> detokenizer_pb2.DetokenizeResponse:
        """Decode one step's tokens and publish the outputs; the reply names the requests to stop:
        a stop string matched, or their frontend is gone."""
        batch = tokens.from_proto(message)
        orphaned = self._introduce(batch, requests)
        processed, stopped = requests.process(batch.requests)
        out: dict[str, OutputBatch] = {}
        for p in processed:
            assert p.state.ref is not None
            out.setdefault(p.state.ref.frontend_id, OutputBatch()).outputs.append(
                _output(p.state, p.text, p.token_ids, p.finish_reason, p.num_cached_prompt_tokens, p.logprobs,
                        p.error, prompt_logprobs=p.prompt_logprobs, embedding=p.embedding))
        if self.metrics:
            self.metrics.stop_string_hits.inc(len(stopped))
            self.metrics.tokens.inc(len(message.token_ids))
        self._publish(out)
        if orphaned:
            logger.warning("%d new request(s) of frontends that went away; stopping them", len(orphaned))
        return detokenizer_pb2.DetokenizeResponse(stopped_handles=stopped, orphaned_handles=orphaned)

    def _introduce(self, batch: TokenBatch, requests: OutputProcessor[int]) -> list[int]:
        """Take the batch's new requests; returns those whose frontend is gone."""
        orphaned = []
        requests.tokenizer = self.tokenizer  # loaded at warm-up, which a stream may have opened before
        for start in batch.new_requests:
            if start.ref.frontend_id not in self.subscribers:
                # Frontends subscribe before they submit: this one has gone (its subscription
                # ended while the request was still queued, so `_orphan` could not name it).
                orphaned.append(start.handle)
                continue
            span = TRACER.start_span("detokenizer.request", context=telemetry.from_message(start.trace_context)) \
                if telemetry.tracing_enabled() else trace.INVALID_SPAN
            requests.add_request(start.handle, start.sampling, start.prompt_tail, start.num_prompt_tokens,
                                 start.resumed_output_token_ids, start.resumed_text_length, start.ref, span)
        return orphaned

    def _publish(self, out: dict[str, OutputBatch]) -> None:
        for frontend_id, frontend_batch in out.items():
            queue = self.subscribers.get(frontend_id)
            if queue is None:
                logger.warning("no subscription from frontend %s; dropping its outputs", frontend_id)
                continue
            queue.put_nowait(outputs.to_proto(frontend_batch))


async def serve(load_tokenizer, model_name: str, server: ServerSettings) -> None:
    """`model_name`: the model whose tokenizer it loads, the label on its metrics."""
    shell = ServiceShell("detokenizer", detokenizer_pb2.DESCRIPTOR.services_by_name["DetokenizerService"], server)
    servicer = DetokenizerServicer(None)
    detokenizer_pb2_grpc.add_DetokenizerServiceServicer_to_server(servicer, shell.server)
    if registry := shell.metrics_registry():
        servicer.metrics = DetokenizerMetrics(registry, model_name)

    async def warm_up() -> None:
        servicer.tokenizer = await asyncio.get_running_loop().run_in_executor(None, load_tokenizer)

    async def drain() -> None:
        servicer.start_draining()
        await wait_until(lambda: not servicer.num_requests)

    await shell.run(warm_up, drain)
