"""The frontend's core, shared by its gRPC shell (server.py) and its HTTP shell (http_server.py):
the state every request shares (the scheduler groups it submits to; one subscription per
detokenizer replica, over which every request's outputs arrive; an outbox per request in flight)
and the one request path: authorize, tokenize (off the event loop), validate, submit (failover.py
keeps it running when it loses a service), and stream the outputs. Failures raise RequestError
with a gRPC status code; each shell turns it into its own transport's error."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Coroutine, Mapping
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from opentelemetry import trace

from vmesh.services.common import telemetry
from vmesh.services.common.admission import InvalidRequest, admit, check_model, check_prompt_length
from vmesh.services.common.generation import Chat, GenerationOutput, GenerationRequest, Prompt, Submission
from vmesh.services.common.metrics import FrontendMetrics
from vmesh.services.common.resume import new_resume_key, prompt_digest
from vmesh.services.common.runtime.discovery import AddressBook, resolve_spec
from vmesh.services.common.runtime.peers import PeerSet
from vmesh.services.common.runtime.retry import Backoff
from vmesh.services.common.runtime.stream import KeptStream
from vmesh.services.common.runtime.tasks import TaskGroup, wait_until
from vmesh.services.common.types import ModelLimits, OutputBatch, OutputMode, RequestRef, SamplingParams, finish_name
from vmesh.services.frontend import schedulers
from vmesh.services.frontend.auth import check_api_key
from vmesh.services.frontend.errors import Code, RequestError
from vmesh.services.frontend.failover import (
    ABORT_TIMEOUT_S,
    DETOKENIZER_LOST,
    MeshPath,
    RecentKeys,
    TimeRemaining,
    abort_stray,
)
from vmesh.services.frontend.inputs import encode_input, prompt_bytes
from vmesh.services.frontend.lora_models import FrontendAdapters
from vmesh.services.frontend.outbox import LostService, Outbox, PendingOutput
from vmesh.services.frontend.request_clock import RequestClock
from vmesh.services.frontend.resumption import take_over, text_the_client_has
from vmesh.services.frontend.schedulers import SchedulerGroup, SchedulerPool
from vmesh.services.frontend.settings import FrontendServiceSettings
from vmesh.services.frontend.structured_requests import LazyGrammarCompiler, SpecCompiler, build_compiler, compile_spec
from vmesh.services.frontend.subscriptions import Subscribe, Subscription, subscribe_over_grpc
from vmesh.services.frontend.tool_parsers import ServedToolFormat, choose_tool_format

logger = logging.getLogger(__name__)

RESUBSCRIBE = Backoff(1.0)
TRACER = telemetry.tracer("vmesh.frontend")
# Tokenizers release the GIL; two threads keep a core for everything else on a small machine.
TOKENIZER_THREADS = 2
# Threads that wait on grammar compiles (the compiler bounds compiling and each wait): never the tokenizers'.
GRAMMAR_WAITERS = 8
Loaded = TypeVar("Loaded")


def model_type(model_dir: Path | None) -> str:
    """config.json's model_type ("": none to read)."""
    try:
        return str(json.loads((model_dir / "config.json").read_text()).get("model_type") or "") if model_dir else ""
    except (OSError, ValueError, AttributeError):
        return ""


def _loaded(value: Loaded | None) -> Loaded:
    """What the frontend loads as it starts (its tokenizer; the model's limits, once the
    schedulers have answered): until then, requests are refused as UNAVAILABLE."""
    if value is None:
        raise RequestError(Code.UNAVAILABLE, "the frontend is starting; try again shortly")
    return value


class FrontendCore:
    def __init__(self, settings: FrontendServiceSettings, *, tokenizer: Any = None, limits: ModelLimits | None = None,
                 connect_scheduler: Callable[[str], tuple[Any, Any]] = schedulers.connect,
                 scheduler_health: Callable[[SchedulerGroup], Any] = schedulers.health_stream,
                 subscribe: Subscribe = subscribe_over_grpc, resubscribe: Backoff = RESUBSCRIBE,
                 metrics: FrontendMetrics | None = None, genai_metrics: telemetry.GenAIServerMetrics | None = None,
                 grammar_compiler: SpecCompiler | None = None,
                 resolve: Callable[[str], list[str]] = resolve_spec):
        """`tokenizer`, `limits`, `grammar_compiler`: when already loaded (else `start` loads the
        tokenizer, the limits are the schedulers' answer, and the compiler is built from both).
        `connect_scheduler`, `scheduler_health`: how a scheduler group is reached and watched
        (SchedulerPool's). `subscribe(frontend_id, address, dispatch, opened)`: one subscription to
        a detokenizer replica, read until it breaks; `resubscribe`: the wait before subscribing
        again to a replica whose subscription broke. `resolve(spec)`: the addresses an address
        spec stands for now (discovery's AddressBook), asked again every refresh interval."""
        self.settings = settings
        self.tokenizer = tokenizer
        self.limits = limits
        self.draining = False
        self.background = TaskGroup()  # aborts that outlive their request
        self.aborted = RecentKeys()
        self.frontend_id = f"frontend-{uuid.uuid4().hex[:12]}"
        self.scheduler_addresses = AddressBook(settings.scheduler_addresses, resolve)
        self.schedulers = SchedulerPool(connect_scheduler, on_lost=self.scheduler_lost, health_stream=scheduler_health,
                                        routing=settings.routing)
        self.adapters = FrontendAdapters(self.schedulers)  # LoRA adapters: models besides the base one
        self.detokenizers = AddressBook(settings.detokenizer_addresses, resolve)
        self.outboxes: dict[int, Outbox] = {}  # by frontend key
        self._subscribe = subscribe
        self.resubscribe = resubscribe
        self.replicas: PeerSet[Subscription] = PeerSet(
            "detokenizer", self._start_subscription, is_idle=self._serves_nothing, stop=Subscription.stop,
            on_retire=lambda subscription: subscription.joined.set())  # start-up stops waiting for it
        self._tasks = TaskGroup()
        self.in_flight = 0
        self.metrics = metrics
        self.genai_metrics = genai_metrics or telemetry.GenAIServerMetrics()
        # Its own pool: a queue of long prompts never delays DNS look-ups or other default-pool work.
        self.tokenizer_pool = concurrent.futures.ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize")
        self.grammar_compiler = grammar_compiler
        self.grammar_pool = concurrent.futures.ThreadPoolExecutor(GRAMMAR_WAITERS, thread_name_prefix="grammar")
        self.model_dir: Path | None = None
        self._tool_format: tuple[Any, ServedToolFormat] | None = None  # (the tokenizer it was chosen for, it)

    @property
    def failover_timeout_s(self) -> float:
        return self.settings.failover_timeout_s

    async def start(self, load_tokenizer: Callable[[], Any], locate_model: Callable[[], Path] | None = None) -> None:
        """Load the tokenizer (off the loop), then join the schedulers and subscribe to the detokenizers.
        `locate_model`: the model directory (the grammar compiler's tokenizer.json and EOS ids)."""
        loop = asyncio.get_running_loop()
        self.tokenizer = await loop.run_in_executor(None, load_tokenizer)
        if locate_model is not None:
            self.model_dir = await loop.run_in_executor(None, locate_model)
        if self.tokenizer is not None:
            logger.info("%s", self.tool_format.describe())
        await self.connect()

    @property
    def tool_format(self) -> ServedToolFormat:
        """The tool-call format of the served model (--tool-call-parser), chosen once per tokenizer;
        the tokenizer's built-in tool prompt asks for it."""
        tokenizer = _loaded(self.tokenizer)
        if self._tool_format is None or self._tool_format[0] is not tokenizer:
            served = choose_tool_format(self.settings.tool_call_parser, tokenizer, model_type(self.model_dir))
            tokenizer.tool_prompt = served.format.prompt
            self._tool_format = (tokenizer, served)
        return self._tool_format[1]

    async def connect(self) -> None:
        await self.join_schedulers()
        if self.grammar_compiler is None and self.tokenizer is not None and self.limits is not None:
            build = partial(build_compiler, self.tokenizer, self.limits, self.model_dir)
            self.grammar_compiler = LazyGrammarCompiler(build)  # xgrammar (and torch) load on first use
        await asyncio.gather(*(self.replicas.add(address).joined.wait() for address in self.detokenizers.addresses))
        refresh_s = self.settings.replica_refresh_interval_s
        self._tasks.spawn(self.replicas.follow(self.detokenizers, refresh_s))
        self._tasks.spawn(self.schedulers.members.follow(self.scheduler_addresses, refresh_s))

    async def join_schedulers(self) -> None:
        """Wait for every listed scheduler group to answer; the model's limits are theirs."""
        groups = [self.schedulers.add(address) for address in self.scheduler_addresses.addresses]
        await asyncio.gather(*(g.joined.wait() for g in groups))
        if not self.schedulers.candidates():
            raise RuntimeError("no scheduler answered")
        limits = self.schedulers.limits
        if limits is None:
            raise RuntimeError("no scheduler told its model")
        model_name = self.settings.model_name
        if model_name is not None and limits.name != model_name:
            # Its tokenizer would turn text into ids of another vocabulary: wrong answers, not errors.
            raise RuntimeError(f"this frontend loaded the tokenizer of {model_name!r}, but the schedulers "
                               f"serve {limits.name!r}; give both the same --model")
        self.limits = limits

    async def close(self) -> None:
        self._tasks.cancel()
        for subscription in self.replicas:
            subscription.stop()
        # Aborts still on their way must reach their schedulers before the channels close, or
        # those requests compute for nobody.
        await self.background.settle(ABORT_TIMEOUT_S)
        await self.schedulers.close()
        self.tokenizer_pool.shutdown(wait=False)
        self.grammar_pool.shutdown(wait=False)

    # --- subscriptions and the outputs they deliver --------------------------------------------

    @property
    def subscribed(self) -> set[str]:
        """Replicas whose subscription is open right now."""
        return {subscription.address for subscription in self.replicas if subscription.alive}

    def listening(self) -> list[str]:
        """Replicas a new request may be routed to: subscribed, and not leaving."""
        return sorted(subscription.address for subscription in self.replicas if subscription.routable)

    def release_if_idle(self, address: str) -> None:
        """A request served by `address` ended: a leaving replica may now be let go."""
        if (subscription := self.replicas.get(address)) is not None:
            self.replicas.release_if_idle(subscription)

    def _start_subscription(self, address: str) -> Subscription:
        subscription = Subscription(address)

        async def broke(exc: Exception) -> bool:
            subscription.alive = False
            logger.error("detokenizer %s unavailable: %s", address, exc)
            self.replica_lost(address, DETOKENIZER_LOST)
            return True  # subscribed again until the replica is let go

        stream = KeptStream(subscription, lambda opened: self._subscribe(self.frontend_id, address, self.dispatch,
                                                                         opened), broke, self.resubscribe)
        subscription.task = asyncio.create_task(stream.run())
        return subscription

    def _serves_nothing(self, subscription: Subscription) -> bool:
        return all(o.detokenizer != subscription.address for o in self.outboxes.values())

    def dispatch(self, batch: OutputBatch) -> None:
        """Outputs from a detokenizer replica, each to its request's outbox (outputs of a key no
        longer served, e.g. one left behind by a failover, are dropped, and its request aborted)."""
        for output in batch.outputs:
            outbox = self.outboxes.get(output.frontend_key)
            if outbox is None:
                if output.finish_reason is None and not output.error:
                    abort_stray(self, output.frontend_key)
                continue
            outbox.put(PendingOutput.received(output))

    def scheduler_lost(self, group: SchedulerGroup) -> None:
        """The group's requests, queued ones included, fail over (their detokenizer may never
        have heard of them, so nothing else would move them)."""
        for outbox in self.outboxes.values():
            if outbox.group is group:
                outbox.put(PendingOutput(error="the scheduler serving this request went away",
                                         lost=LostService.SCHEDULER))

    def replica_lost(self, address: str, message: str) -> None:
        """The replica's requests fail over to another one (or to it, restarted)."""
        for outbox in self.outboxes.values():
            if outbox.detokenizer == address:
                outbox.put(PendingOutput(error=message, lost=LostService.DETOKENIZER))

    def register(self, outbox: Outbox) -> int:
        """A new frontend key for `outbox`, unpredictable: no other caller can claim the next one first."""
        while (frontend_key := secrets.randbits(63)) == 0 or frontend_key in self.outboxes:  # 0: the wire's unset
            pass
        self.outboxes[frontend_key] = outbox
        return frontend_key

    def unregister(self, frontend_key: int, outbox: Outbox) -> None:
        self.outboxes.pop(frontend_key, None)
        if outbox.detokenizer:
            self.release_if_idle(outbox.detokenizer)

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """A task that outlives the request that started it (an abort), referenced until done."""
        self.background.spawn(work)

    # --- the request path ----------------------------------------------------------------------

    def authorize(self, authorization: str | None) -> None:
        check_api_key(self.settings.api_key, authorization)

    def ready(self) -> None:
        """Refuse new work while the frontend starts (no tokenizer or scheduler yet) or drains."""
        _loaded(self.tokenizer)
        _loaded(self.limits)
        if self.draining:
            raise RequestError(Code.UNAVAILABLE, "the frontend is draining")

    def loaded_limits(self) -> ModelLimits:
        """The served model's limits, once the schedulers have answered (`ready` refuses work before)."""
        return _loaded(self.limits)

    async def encode(self, prompt: Prompt | None) -> list[int]:
        """A request's input as token ids, tokenized on a worker thread so that a long prompt
        never stalls the streams of other requests."""
        tokenizer = _loaded(self.tokenizer)
        if isinstance(prompt, Chat):
            self.tool_format  # noqa: B018 - chosen before a chat renders: its built-in tool prompt asks for it
        try:
            size = prompt_bytes(prompt)
            if size > self.settings.max_prompt_bytes:
                raise InvalidRequest("prompt", f"{size} bytes of text; at most {self.settings.max_prompt_bytes} "
                                               "are accepted")
            if prompt is not None and not isinstance(prompt, (str, Chat)):  # token ids: nothing to tokenize
                if self.limits is not None:  # before any copy: a request may hold millions of ids
                    check_prompt_length(len(prompt), self.limits)
                return encode_input(tokenizer, prompt)
            context = self.limits.max_model_len if self.limits else None
            return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, encode_input, tokenizer,
                                                                    prompt, context)
        except InvalidRequest as exc:
            raise RequestError.invalid(exc) from exc

    async def generate(self, request: GenerationRequest, time_remaining: TimeRemaining = lambda: None,
                       trace_headers: Mapping[str, str] | None = None, operation: str | None = None,
                       ) -> AsyncGenerator[GenerationOutput, None]:
        """One request, start to end, as a stream of outputs. Closing the stream early
        (the client left) aborts the request wherever it still runs. `trace_headers`: the caller's
        W3C `traceparent`/`tracestate` (gRPC metadata or HTTP headers), which the request's trace
        continues. `operation`: the GenAI operation when the input does not say (a chat whose
        prompt arrives tokenized)."""
        operation = operation or ("chat" if request.is_chat else "text_completion")
        model = request.model or (self.limits.name if self.limits else "")
        # OpenTelemetry's GenAI conventions: the span is named "{operation} {model}".
        attributes = {"gen_ai.operation.name": operation, "gen_ai.provider.name": "vmesh",
                      "gen_ai.request.model": model}
        span = TRACER.start_span(f"{operation} {model}".strip(), kind=trace.SpanKind.SERVER,
                                 context=telemetry.from_headers(trace_headers), attributes=attributes)
        clock = RequestClock(self.metrics)
        output_tokens = 0
        error_type: str | None = None
        try:
            async for out in self._generate(request, time_remaining, span, clock):
                if out.usage is not None:
                    output_tokens = out.usage.completion_tokens
                yield out
        except BaseException as exc:
            span.set_status(trace.Status(trace.StatusCode.ERROR, type(exc).__name__))
            # GeneratorExit: the client went away mid-stream, which gRPC reports as CANCELLED.
            error_type = (exc.code.name if isinstance(exc, RequestError)
                          else "CANCELLED" if isinstance(exc, (GeneratorExit, asyncio.CancelledError))
                          else type(exc).__name__)
            raise
        finally:
            span.end()
            if self.limits:
                attributes["gen_ai.response.model"] = self.limits.name
            self.genai_metrics.record(attributes, clock.started, clock.first_token_at, time.monotonic(),
                                      output_tokens, error_type)

    async def _generate(self, request: GenerationRequest, time_remaining: TimeRemaining, span: trace.Span,
                        clock: RequestClock) -> AsyncGenerator[GenerationOutput, None]:
        self.ready()
        prompt = await self.encode(request.prompt)
        self.ready()  # a drain that began while this prompt was tokenizing counted no request in flight
        lora_name = await self.adapters.resolve(request.model, self.loaded_limits().name)
        params = await self._compiled(_admit(request, prompt, self.loaded_limits(), span, lora_name), span)
        digest = prompt_digest(prompt)
        resumed: list[int] = []
        resumed_text = ""
        if (resume := request.resume_from) is not None:
            resumed = await take_over(self, resume, digest)
            resumed_text = text_the_client_has(_loaded(self.tokenizer), params, prompt, resumed, resume.text_length)
            span.add_event("vmesh.resume", {"vmesh.resumed_output_tokens": len(resumed)})
        outbox = Outbox(delta_text=params.output_mode is OutputMode.DELTA)
        outbox.resume(resumed, len(resumed_text))
        # The frontend key names the request inside the mesh (with this frontend's id); the client
        # sees it as the request id.
        frontend_key = self.register(outbox)
        request_id = str(frontend_key)
        span.set_attribute("gen_ai.response.id", RequestRef(self.frontend_id, frontend_key).key)
        resume_key = request.resume_key or new_resume_key()
        route = MeshPath(self, Submission(self.frontend_id, frontend_key, prompt, params, request.priority,
                                          telemetry.trace_context(span), resumed_output_token_ids=list(resumed),
                                          resumed_text_length=len(resumed_text), lora_name=lora_name,
                                          resume_key=resume_key, prompt_digest=digest),
                         outbox, time_remaining, span)
        finished = False
        backend = params.grammar.backend if params.grammar is not None else ""
        scored_prompt = prompt if params.prompt_logprobs is not None else []  # sent with the first tokens
        self.in_flight += 1
        try:
            await route.submit()
            while True:
                out = await outbox.get()
                if out.error and not route.may_fail_over(out):
                    # Not marked finished: closing the route stops it wherever it still runs.
                    raise RequestError(Code.UNAVAILABLE, out.error)
                finished = out.finished and not out.error
                clock.observe(out, finished)
                if finished and out.usage is not None:
                    span.set_attributes({"gen_ai.usage.output_tokens": out.usage.completion_tokens,
                                         "gen_ai.usage.cache_read.input_tokens": out.usage.cached_prompt_tokens,
                                         "gen_ai.response.finish_reasons": [finish_name(out.finish_reason)]})
                if not out.error or out.text or out.token_ids:
                    yield GenerationOutput(request_id, out.text, out.token_ids, out.logprobs, out.finish_reason,
                                           out.usage, backend, scored_prompt if out.token_ids else [],
                                           out.prompt_logprobs, out.embedding, resume_key, resumed_text,
                                           resumed)
                    backend, resume_key, resumed_text, resumed = "", "", "", []  # said once
                    scored_prompt = scored_prompt if not out.token_ids else []
                if finished:
                    return
                if out.lost:
                    await route.fail_over(out, request_id)
        finally:
            self.in_flight -= 1
            route.close(finished)

    async def _compiled(self, params: SamplingParams, span: trace.Span) -> SamplingParams:
        """`params` with its structured output compiled off the loop, before anything is submitted."""
        if params.structured is None:
            return params
        if self.grammar_compiler is None:
            raise RequestError.invalid(InvalidRequest("sampling.structured", "this model's output cannot be "
                                                                             "constrained (no tokenizer.json)"))
        try:
            grammar = await asyncio.get_running_loop().run_in_executor(
                self.grammar_pool, compile_spec, self.grammar_compiler, params.structured)
        except InvalidRequest as exc:
            raise RequestError.invalid(exc) from exc
        params.grammar = grammar
        span.set_attributes({"vmesh.structured_output.kind": params.structured.kind,
                             "vmesh.structured_output.backend": grammar.backend})
        self.ready()  # a drain that began meanwhile counted no request in flight
        return params

    def serving(self) -> bool:
        """Started, not draining, and at least one scheduler group and detokenizer to use."""
        return (self.tokenizer is not None and self.limits is not None and not self.draining
                and bool(self.schedulers.candidates()) and bool(self.listening()))

    async def drain(self) -> None:
        self.draining = True  # new requests are refused from here on; those in flight finish
        await wait_until(lambda: not self.in_flight)


def _admit(request: GenerationRequest, prompt: list[int], limits: ModelLimits, span: trace.Span,
           lora_name: str = "") -> SamplingParams:
    """The request's sampling params (max_tokens, unset: the context's room), once the model can
    serve it: the request's own copy, which the frontend completes (its compiled grammar) and
    forwards, so that requests sharing params (a fan-out's copies) stay apart."""
    try:
        check_model("" if lora_name else request.model, limits)  # a LoRA adapter's name is a model too
        room = limits.max_model_len - len(prompt)
        params = replace(request.sampling, max_tokens=room if request.max_tokens_from_context
                         else request.sampling.max_tokens)
        if params.grammar is not None:  # the frontend's to compile, so that what reaches the worker is checked
            raise InvalidRequest("sampling.grammar", "set by the frontend from sampling.structured; a client may not "
                                                     "send a compiled grammar")
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
