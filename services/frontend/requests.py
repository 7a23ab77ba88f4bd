"""The frontend's one request path, shared by its gRPC and HTTP shells: authorize, tokenize (off
the event loop), validate, submit to a scheduler group, and stream the outputs that arrive from
the detokenizers. Failures raise RequestError with a gRPC status code; each shell turns it into
its own transport's error (gRPC status, or an HTTP status with OpenAI's error body)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import hmac
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from opentelemetry import trace

from vmesh.services.common import telemetry
from vmesh.services.common.admission import InvalidRequest, admit, check_model, check_prompt_length
from vmesh.services.common.tokenizer import encode_chat
from vmesh.services.common.types import ModelLimits, OutputMode, RequestRef, SamplingParams, finish_name
from vmesh.services.common.wire.common import finish_to_proto
from vmesh.services.common.wire.public import logprobs_to_public, usage_to_public
from vmesh.services.common.wire.sampling import sampling_from_proto, sampling_to_proto
from vmesh.services.frontend.errors import Code, RequestError
from vmesh.services.frontend.outbox import LostService, Outbox, PendingOutput
from vmesh.services.frontend.prefix_routing import prefix_hashes
from vmesh.services.frontend.schedulers import SchedulerGroup
from vmesh.v1 import frontend_pb2, scheduler_pb2

if TYPE_CHECKING:
    from vmesh.services.frontend.server import FrontendServicer

logger = logging.getLogger(__name__)

SUBMIT_TIMEOUT_S = 30.0
MAX_FAILOVERS = 8  # per request: a request that keeps losing its services is given up
TARGET_POLL_S = 0.1
TRACER = telemetry.tracer("vmesh.frontend")
GENAI_METRICS = telemetry.GenAIServerMetrics()
_PASSED_THROUGH = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                   grpc.StatusCode.DEADLINE_EXCEEDED}
# Tokenizers release the GIL; two threads keep a core for everything else on a small machine.
TOKENIZER_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
Loaded = TypeVar("Loaded")


def check_api_key(expected: str | None, authorization: str | None) -> None:
    """`authorization`: the `Authorization` header (HTTP) or `authorization` metadata (gRPC)."""
    if not expected:
        return
    scheme, _, token = (authorization or "").partition(" ")
    # Digests of equal length: the time taken says nothing of the key, not even its length.
    given = hashlib.sha256(token.strip().encode()).digest()
    if scheme.lower() != "bearer" or not hmac.compare_digest(given, hashlib.sha256(expected.encode()).digest()):
        raise RequestError(Code.UNAUTHENTICATED, "missing or invalid API key (expected 'Authorization: Bearer KEY')")


def prompt_bytes(which: str | None, message: Any) -> int:
    if which == "text":
        return len(message.text.encode())
    if which == "chat":
        return sum(len(m.content.encode()) + len(m.role.encode()) for m in message.chat.messages)
    return 0


def _encode(tokenizer: Any, which: str | None, message: Any) -> list[int]:
    if which == "text":
        return tokenizer.encode(message.text) if message.text else []
    if which == "chat":
        messages = [{"role": m.role, "content": m.content} for m in message.chat.messages]
        if not messages:
            raise InvalidRequest("chat", "no messages")
        try:
            return encode_chat(tokenizer, messages)
        except Exception as exc:  # the template rejects the conversation (roles, order)
            raise InvalidRequest("chat", str(exc)) from exc
    if which == "token_ids":
        return list(message.token_ids.ids)
    raise InvalidRequest("input", "one of text, chat or token_ids is required")


async def encode(frontend: FrontendServicer, message: Any) -> list[int]:
    """Token ids of a GenerateRequest's or TokenizeRequest's input, tokenized on a worker
    thread so that a long prompt never stalls the streams of other requests."""
    tokenizer = _loaded(frontend.tokenizer)
    which = message.WhichOneof("input")
    try:
        size = prompt_bytes(which, message)
        if size > frontend.max_prompt_bytes:
            raise InvalidRequest("prompt", f"{size} bytes of text; at most {frontend.max_prompt_bytes} are accepted")
        if which == "token_ids":  # nothing to tokenize
            if frontend.limits is not None:  # before any copy: a message may hold millions of ids
                check_prompt_length(len(message.token_ids.ids), frontend.limits)
            return _encode(tokenizer, which, message)
        # Its own pool: a queue of long prompts never delays DNS look-ups or other default-pool work.
        return await asyncio.get_running_loop().run_in_executor(TOKENIZER_POOL, _encode, tokenizer, which, message)
    except InvalidRequest as exc:
        raise RequestError.invalid(exc) from exc


def _loaded(value: Loaded | None) -> Loaded:
    """What the frontend loads as it starts (its tokenizer; the model's limits, once the
    schedulers have answered): until then, requests are refused as UNAVAILABLE."""
    if value is None:
        raise RequestError(Code.UNAVAILABLE, "the frontend is starting; try again shortly")
    return value


def ready(frontend: FrontendServicer) -> None:
    """Refuse new work while the frontend starts (no tokenizer or scheduler yet) or drains."""
    _loaded(frontend.tokenizer)
    _loaded(frontend.limits)
    if frontend.draining:
        raise RequestError(Code.UNAVAILABLE, "the frontend is draining")


def loaded_limits(frontend: FrontendServicer) -> ModelLimits:
    """The served model's limits, once the schedulers have answered (`ready` refuses work before)."""
    return _loaded(frontend.limits)


def spawn(frontend: FrontendServicer, work: Coroutine[Any, Any, None]) -> None:
    """A task that outlives the request that started it (an abort), referenced until done."""
    frontend.background.spawn(work)


async def generate(frontend: FrontendServicer, request: frontend_pb2.GenerateRequest,
                   time_remaining: Callable[[], float | None] = lambda: None,
                   trace_headers: Mapping[str, str] | None = None, operation: str | None = None,
                   ) -> AsyncGenerator[frontend_pb2.GenerateResponse, None]:
    """One request, start to end, as a stream of GenerateResponses. Closing the stream early
    (the client left) aborts the request wherever it still runs. `trace_headers`: the caller's
    W3C `traceparent`/`tracestate` (gRPC metadata or HTTP headers), which the request's trace
    continues. `operation`: the GenAI operation when the input does not say (a chat whose
    prompt arrives tokenized)."""
    operation = operation or ("chat" if request.WhichOneof("input") == "chat" else "text_completion")
    model = request.model or (frontend.limits.name if frontend.limits else "")
    # OpenTelemetry's GenAI conventions: the span is named "{operation} {model}".
    attributes = {"gen_ai.operation.name": operation, "gen_ai.provider.name": "vmesh", "gen_ai.request.model": model}
    span = TRACER.start_span(f"{operation} {model}".strip(), kind=trace.SpanKind.SERVER,
                             context=telemetry.from_headers(trace_headers), attributes=attributes)
    started = time.monotonic()
    first_token_at: float | None = None
    output_tokens = 0
    error_type: str | None = None
    try:
        async for response in _generate(frontend, request, time_remaining, span):
            if response.token_ids and first_token_at is None:
                first_token_at = time.monotonic()
            if response.HasField("usage"):
                output_tokens = response.usage.completion_tokens
            yield response
    except BaseException as exc:
        span.set_status(trace.Status(trace.StatusCode.ERROR, type(exc).__name__))
        # GeneratorExit: the client went away mid-stream, which gRPC reports as CANCELLED.
        error_type = (exc.code.name if isinstance(exc, RequestError)
                      else "CANCELLED" if isinstance(exc, (GeneratorExit, asyncio.CancelledError))
                      else type(exc).__name__)
        raise
    finally:
        span.end()
        if frontend.limits:
            attributes["gen_ai.response.model"] = frontend.limits.name
        GENAI_METRICS.record(attributes, started, first_token_at, time.monotonic(), output_tokens, error_type)


async def _generate(frontend: FrontendServicer, request: frontend_pb2.GenerateRequest,
                    time_remaining: Callable[[], float | None], span: trace.Span,
                    ) -> AsyncIterator[frontend_pb2.GenerateResponse]:
    ready(frontend)
    prompt = await encode(frontend, request)
    ready(frontend)  # a drain that began while this prompt was tokenizing counted no request in flight
    params = _admit(request, prompt, loaded_limits(frontend), span)
    # The frontend key names the request inside the mesh (with this frontend's id); the client
    # sees it as the request id.
    frontend_key = next(frontend.frontend_keys)
    request_id = str(frontend_key)
    span.set_attribute("gen_ai.response.id", RequestRef(frontend.frontend_id, frontend_key).key)
    outbox = frontend.outboxes[frontend_key] = Outbox(delta_text=params.output_mode is OutputMode.DELTA)
    finished = False
    frontend.in_flight += 1
    started = last_token_at = time.monotonic()
    first_token = True
    metrics = frontend.metrics
    group: SchedulerGroup | None = None
    failovers = 0
    submission = scheduler_pb2.SubmitRequestRequest(
        frontend_id=frontend.frontend_id, frontend_key=frontend_key, prompt_token_ids=prompt,
        sampling=sampling_to_proto(params), priority=request.priority, trace_context=telemetry.to_proto(span))
    try:
        group = await _submit_when_possible(frontend, submission, outbox, time_remaining)
        while True:
            out = await outbox.get()
            if out.error and (not out.lost or failovers == MAX_FAILOVERS):
                # Not marked finished: the abort below stops it wherever it still runs.
                raise RequestError(Code.UNAVAILABLE, out.error)
            finished = out.finished and not out.error
            if metrics and out.token_ids:
                now = time.monotonic()
                if first_token:
                    metrics.ttft.observe(now - started)
                    first_token = False
                else:  # merged outputs spread their gap over their tokens
                    for _ in out.token_ids:
                        metrics.itl.observe((now - last_token_at) / len(out.token_ids))
                last_token_at = now
            if metrics and finished:
                metrics.e2e.observe(time.monotonic() - started)
                metrics.request_finished(finish_name(out.finish_reason))
            if finished and out.usage is not None:
                span.set_attributes({"gen_ai.usage.output_tokens": out.usage.completion_tokens,
                                     "gen_ai.usage.cache_read.input_tokens": out.usage.cached_prompt_tokens,
                                     "gen_ai.response.finish_reasons": [finish_name(out.finish_reason)]})
            if not out.error or out.text or out.token_ids:
                yield frontend_pb2.GenerateResponse(
                    request_id=request_id, text=out.text, token_ids=out.token_ids,
                    logprobs=logprobs_to_public(out.logprobs), finish_reason=finish_to_proto(out.finish_reason),
                    usage=usage_to_public(out.usage))
            if finished:
                return
            if out.lost:  # its scheduler or detokenizer replica was lost: continue elsewhere
                failovers += 1
                logger.warning("request %s: %s; failing over with %d output token(s)", request_id, out.error,
                               len(outbox.received_token_ids))
                span.add_event("vmesh.failover", {"vmesh.failover.kind": out.lost.value,
                                                  "vmesh.resumed_output_tokens": len(outbox.received_token_ids)})
                if metrics:
                    metrics.failover(out.lost.value)
                # Aborted there even when its scheduler looks gone: it may be alive behind a broken link.
                _let_go(frontend, outbox, submission.frontend_key, group)
                group = None
                submission.frontend_key = next(frontend.frontend_keys)
                submission.resumed_output_token_ids[:] = outbox.received_token_ids
                submission.resumed_text_length = outbox.received_text_length
                frontend.outboxes[submission.frontend_key] = outbox
                outbox.reopen()
                group = await _submit_when_possible(frontend, submission, outbox, time_remaining)
    finally:
        frontend.in_flight -= 1
        if group is not None and finished:  # nothing left to abort
            frontend.schedulers.release(group)
            group = None
        # Unfinished (the client went away, its deadline passed, or it failed): abort it everywhere.
        _let_go(frontend, outbox, submission.frontend_key, group)


def _admit(request: frontend_pb2.GenerateRequest, prompt: list[int], limits: ModelLimits,
           span: trace.Span) -> SamplingParams:
    """The request's sampling params with defaults filled (max_tokens: the context's room), once
    the model can serve it: the form the frontend forwards, every field set, so that every
    later door decodes the same settings."""
    try:
        check_model(request.model, limits)
        params = sampling_from_proto(request.sampling, default_max_tokens=limits.max_model_len - len(prompt))
        admit(prompt, params, limits)
    except InvalidRequest as exc:
        raise RequestError.invalid(exc) from exc
    span.set_attributes({"gen_ai.request.max_tokens": params.max_tokens,
                         "gen_ai.request.temperature": params.temperature, "gen_ai.request.top_p": params.top_p,
                         "gen_ai.usage.input_tokens": len(prompt), "gen_ai.response.model": limits.name})
    if params.top_k > 0:
        span.set_attribute("gen_ai.request.top_k", params.top_k)
    if params.seed is not None:
        span.set_attribute("gen_ai.request.seed", params.seed)
    return params


def _let_go(frontend: FrontendServicer, outbox: Outbox, frontend_key: int, group: SchedulerGroup | None) -> None:
    """Stop serving `frontend_key` through `outbox`: its group aborts it (wherever it still runs;
    a lost group's abort just fails) and a leaving replica may go once it serves nothing else."""
    frontend.outboxes.pop(frontend_key, None)
    if outbox.detokenizer:
        frontend.release_if_idle(outbox.detokenizer)
    if group is not None:
        spawn(frontend, abort(frontend, group, frontend_key))
    outbox.group = outbox.detokenizer = None


async def _submit_when_possible(frontend: FrontendServicer, submission: scheduler_pb2.SubmitRequestRequest,
                                outbox: Outbox, time_remaining: Callable[[], float | None]) -> SchedulerGroup:
    """Submit once a scheduler group and a detokenizer replica are there to take the request,
    waiting up to the failover timeout for them (a lost one restarting): a group that refuses
    with UNAVAILABLE is tried again until then. Returns the group that took it."""
    deadline = time.monotonic() + frontend.failover_timeout_s
    while True:
        remaining = time_remaining()
        if remaining is not None and remaining <= 0:
            raise RequestError(Code.DEADLINE_EXCEEDED, "the request's deadline passed before it was submitted")
        listening = frontend.listening()
        if listening and frontend.schedulers.candidates():
            submission.detokenizers[:] = listening
            try:
                group, reply = await submit(frontend, submission, time_remaining)
            except RequestError as exc:
                if exc.code != Code.UNAVAILABLE or time.monotonic() > deadline:
                    raise
            else:
                outbox.group = group
                outbox.detokenizer = reply.detokenizer
                if reply.detokenizer not in frontend.subscribed:  # lost while the scheduler chose it
                    outbox.put(PendingOutput(error="the detokenizer serving this request became unavailable",
                                         lost=LostService.DETOKENIZER))
                return group
        elif time.monotonic() > deadline:
            what = "detokenizer replica is reachable" if not listening else "scheduler is available"
            raise RequestError(Code.UNAVAILABLE, f"no {what}")
        await asyncio.sleep(TARGET_POLL_S)


async def submit(frontend: FrontendServicer, submission: scheduler_pb2.SubmitRequestRequest,
                 time_remaining: Callable[[], float | None] = lambda: None,
                 ) -> tuple[SchedulerGroup, scheduler_pb2.SubmitRequestResponse]:
    """Submit to the group routing prefers (prefix_routing.py; or the least busy); a group that
    is down or failed did not take the request, so the next one is tried. Raises RequestError when
    no group takes it."""
    error: grpc.aio.AioRpcError | None = None
    hashes: list[int] = []
    if frontend.schedulers.prefix_router is not None:  # what the group will cache: prompt and resumed outputs
        hashes = prefix_hashes([*submission.prompt_token_ids, *submission.resumed_output_token_ids])
    for group in frontend.schedulers.candidates(hashes):
        remaining = time_remaining()
        if remaining is not None and remaining <= 0:
            raise RequestError(Code.DEADLINE_EXCEEDED, "the request's deadline passed before it was submitted")
        timeout = min(SUBMIT_TIMEOUT_S, remaining) if remaining is not None else SUBMIT_TIMEOUT_S
        frontend.schedulers.acquire(group)
        call = asyncio.ensure_future(group.stub.SubmitRequest(submission, timeout=timeout))
        try:
            reply = await asyncio.shield(call)
            frontend.schedulers.routed(group, hashes)
            return group, reply
        except asyncio.CancelledError:
            # The client left while the scheduler was taking the request: the scheduler may
            # still take it, so abort it there once the submission resolves.
            spawn(frontend, _abort_once_submitted(frontend, call, group, submission.frontend_key))
            raise
        except grpc.aio.AioRpcError as exc:
            frontend.schedulers.release(group)
            error = exc
            if exc.code() != grpc.StatusCode.UNAVAILABLE:
                break
    if error is None:
        raise RequestError(Code.UNAVAILABLE, "no scheduler is available")
    if error.code() in _PASSED_THROUGH:  # the scheduler's own words about the request
        raise RequestError(error.code(), error.details())
    # gRPC's text names internal addresses: the log keeps it, the client gets the gist.
    logger.warning("submission failed: %s %s", error.code().name, error.details())
    raise RequestError(grpc.StatusCode.UNAVAILABLE, "no scheduler is available")


async def _abort_once_submitted(frontend: FrontendServicer, call: asyncio.Future, group: SchedulerGroup,
                                frontend_key: int) -> None:
    try:
        await call
    except (grpc.aio.AioRpcError, asyncio.CancelledError):  # it never took the request
        frontend.schedulers.release(group)
        return
    await abort(frontend, group, frontend_key)


async def abort(frontend: FrontendServicer, group: SchedulerGroup, frontend_key: int) -> None:
    try:
        await group.stub.AbortRequest(scheduler_pb2.AbortRequestRequest(
            frontend_id=frontend.frontend_id, frontend_key=frontend_key), timeout=5)
    except grpc.aio.AioRpcError as exc:  # its scheduler is gone, say: then so is the request
        logger.info("abort of request %d failed: %s", frontend_key, exc.details())
    finally:
        frontend.schedulers.release(group)


def model_info(frontend: FrontendServicer) -> frontend_pb2.GetModelInfoResponse:
    limits = loaded_limits(frontend)
    return frontend_pb2.GetModelInfoResponse(model=limits.name, max_model_len=limits.max_model_len,
                                             vocab_size=limits.vocab_size)
