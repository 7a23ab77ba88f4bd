"""The frontend's gRPC shell: the public API. Tokenizes and validates, submits to the
scheduler, and streams each request's outputs, which arrive from the detokenizer replicas
over one subscription per replica."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid

import grpc
from opentelemetry import trace

from services.common import telemetry
from services.common.discovery import DEFAULT_REFRESH_INTERVAL_S, AddressBook, watch
from services.common.grpc_server import ServiceShell, channel
from services.common.metrics import FrontendMetrics
from services.frontend.outbox import Outbox, PendingOutput
from services.frontend.schedulers import SchedulerGroup, SchedulerPool
from services.frontend.validation import InvalidRequest, ModelLimits, validate_generate
from vmesh.v1 import (
    detokenizer_pb2,
    detokenizer_pb2_grpc,
    frontend_pb2,
    frontend_pb2_grpc,
    scheduler_pb2,
)

logger = logging.getLogger(__name__)

SUBMIT_TIMEOUT_S = 30.0
TRACER = telemetry.tracer("vmesh.frontend")
_PASSED_THROUGH = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
_FINISH_NAMES = {0: "", 1: "stop", 2: "length", 3: "abort"}


class FrontendServicer(frontend_pb2_grpc.FrontendServiceServicer):
    def __init__(self, tokenizer, scheduler_specs: list[str], detokenizer_specs: list[str],
                 replica_refresh_interval_s: float = DEFAULT_REFRESH_INTERVAL_S):
        """Specs: host:port or dns:///name:port entries, re-resolved periodically. Several
        schedulers are several worker groups (data parallelism)."""
        self.tokenizer = tokenizer
        self.frontend_id = f"frontend-{uuid.uuid4().hex[:12]}"
        self.scheduler_addresses = AddressBook(scheduler_specs)
        self.schedulers = SchedulerPool()
        self.detokenizers = AddressBook(detokenizer_specs)
        self.replica_refresh_interval_s = replica_refresh_interval_s
        self.outboxes: dict[int, Outbox] = {}
        self.keys = itertools.count(1)
        self.limits: ModelLimits | None = None
        self.subscribed: set[str] = set()  # open subscriptions
        self.subscriptions: dict[str, asyncio.Task] = {}
        self.retired: set[str] = set()  # replicas that left the list, kept until their last request ends
        self._tasks: list[asyncio.Task] = []
        self.in_flight = 0
        self.metrics: FrontendMetrics | None = None

    async def connect(self) -> None:
        groups = [self.schedulers.add(address) for address in self.scheduler_addresses.addresses]
        await asyncio.gather(*(g.joined.wait() for g in groups))
        if not self.schedulers.candidates():
            raise RuntimeError("no scheduler answered")
        self.limits = self.schedulers.limits
        subscribed = [self._start_subscription(address) for address in self.detokenizers.addresses]
        await asyncio.gather(*subscribed)
        self._tasks += [
            asyncio.create_task(watch(self.detokenizers, self.replica_refresh_interval_s, self._replicas_changed)),
            asyncio.create_task(watch(self.scheduler_addresses, self.replica_refresh_interval_s,
                                      self._schedulers_changed))]

    def _schedulers_changed(self, joined: list[str], left: list[str]) -> None:
        for address in joined:
            self.schedulers.add(address)
        for address in left:
            self.schedulers.remove(address)

    async def close(self) -> None:
        for task in [*self._tasks, *self.subscriptions.values()]:
            task.cancel()
        await self.schedulers.close()

    # --- subscriptions -----------------------------------------------------------------------

    def _start_subscription(self, address: str) -> asyncio.Future:
        """Subscribe to a replica; the future completes once the subscription is open."""
        ready = asyncio.get_running_loop().create_future()
        self.subscriptions[address] = asyncio.create_task(self._subscribe(address, ready))
        return ready

    def _replicas_changed(self, joined: list[str], left: list[str]) -> None:
        for address in joined:
            self.retired.discard(address)
            if address not in self.subscriptions:
                self._start_subscription(address)
        for address in left:
            if address in self.subscriptions:
                self.retired.add(address)
                self._close_if_idle(address)

    def _close_if_idle(self, address: str) -> None:
        if address in self.retired and all(o.detokenizer != address for o in self.outboxes.values()):
            self.retired.discard(address)
            self.subscribed.discard(address)
            self.subscriptions.pop(address).cancel()
            logger.info("detokenizer %s left", address)

    async def _subscribe(self, address: str, ready: asyncio.Future) -> None:
        """Keep one subscription open to a replica; when it breaks, fail the requests it was
        serving and subscribe again."""
        while True:
            try:
                async with channel(address) as ch:
                    stub = detokenizer_pb2_grpc.DetokenizerServiceStub(ch)
                    call = stub.Subscribe(detokenizer_pb2.SubscribeRequest(frontend_id=self.frontend_id),
                                          wait_for_ready=True)
                    # The replica sends metadata once it has registered us.
                    await call.initial_metadata()
                    self.subscribed.add(address)
                    if not ready.done():
                        ready.set_result(None)
                    async for batch in call:
                        self._dispatch(batch)
                    raise ConnectionError("subscription closed")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.subscribed.discard(address)
                self._fail_replica(address, f"detokenizer {address} unavailable: {exc}")
            await asyncio.sleep(1.0)

    def _dispatch(self, batch: detokenizer_pb2.SubscribeResponse) -> None:
        token_offset = logprob_row = top_offset = 0
        for i, key in enumerate(batch.frontend_keys):
            n = batch.num_tokens[i]
            token_ids = list(batch.token_ids[token_offset:token_offset + n])
            token_offset += n
            logprobs = []
            for _ in range(batch.num_logprobs_rows[i]):
                k = batch.num_top[logprob_row]
                span = slice(top_offset, top_offset + k)
                top = [frontend_pb2.TokenLogprob(token_id=t, logprob=lp)
                       for t, lp in zip(batch.top_token_ids[span], batch.top_logprobs[span])]
                logprobs.append(frontend_pb2.GeneratedTokenLogprobs(
                    logprob=batch.sampled_logprobs[logprob_row], rank=batch.sampled_ranks[logprob_row], top=top))
                top_offset += k
                logprob_row += 1
            outbox = self.outboxes.get(key)
            if outbox is None:
                continue
            out = PendingOutput(text=batch.texts[i], token_ids=token_ids, logprobs=logprobs,
                                finish_reason=batch.finish_reasons[i], error=batch.errors[i] if batch.errors else "")
            if out.finished:
                out.usage = frontend_pb2.Usage(prompt_tokens=batch.num_prompt_tokens[i],
                                               completion_tokens=batch.num_output_tokens[i],
                                               cached_prompt_tokens=batch.num_cached_prompt_tokens[i])
            outbox.put(out)

    def _fail_replica(self, address: str, message: str) -> None:
        logger.error("%s", message)
        for outbox in self.outboxes.values():
            if outbox.detokenizer == address:
                outbox.put(PendingOutput(error=message))

    # --- RPCs --------------------------------------------------------------------------------

    def _encode(self, which: str, message) -> list[int]:
        if which == "text":
            return self.tokenizer.encode(message.text) if message.text else []
        if which == "chat":
            messages = [{"role": m.role, "content": m.content} for m in message.chat.messages]
            if not messages:
                raise InvalidRequest("chat: no messages")
            try:
                return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                          return_dict=False)
            except Exception as exc:  # the template rejects the conversation (roles, order)
                raise InvalidRequest(f"chat: {exc}") from exc
        if which == "token_ids":
            return list(message.token_ids.ids)
        raise InvalidRequest("input: one of text, chat or token_ids is required")

    async def Generate(self, request, context):
        which = request.WhichOneof("input")
        span = TRACER.start_span("generate", kind=trace.SpanKind.SERVER, attributes={
            "gen_ai.operation.name": "chat" if which == "chat" else "text_completion",
            "gen_ai.system": "vmesh", "gen_ai.request.model": request.model or self.limits.name})
        try:
            async for response in self._generate(request, context, which, span):
                yield response
        except BaseException as exc:
            span.set_status(trace.Status(trace.StatusCode.ERROR, type(exc).__name__))
            raise
        finally:
            span.end()

    async def _generate(self, request, context, which: str, span: trace.Span):
        try:
            prompt = self._encode(which, request)
            params = validate_generate(request, prompt, self.limits)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        span.set_attributes({"gen_ai.request.max_tokens": params.max_tokens,
                             "gen_ai.request.temperature": params.temperature, "gen_ai.request.top_p": params.top_p,
                             "gen_ai.usage.input_tokens": len(prompt)})
        key = next(self.keys)
        request_id = f"{key}"
        span.set_attribute("gen_ai.response.id", f"{self.frontend_id}/{request_id}")
        outbox = self.outboxes[key] = Outbox(delta_text=params.output_mode.value == "delta")
        sampling = request.sampling
        sampling.max_tokens = params.max_tokens
        finished = False
        self.in_flight += 1
        started = last_token_at = time.monotonic()
        first_token = True
        metrics = self.metrics
        if metrics:
            metrics.prompt_tokens.inc(len(prompt))
        group: SchedulerGroup | None = None
        try:
            listening = sorted(self.subscribed - self.retired)
            if not listening:
                finished = True  # nothing to abort
                await context.abort(grpc.StatusCode.UNAVAILABLE, "no detokenizer replica is reachable")
            submission = scheduler_pb2.SubmitRequestRequest(
                request_id=request_id, frontend_id=self.frontend_id, frontend_key=key, prompt_token_ids=prompt,
                sampling=sampling, priority=request.priority, trace_context=telemetry.to_proto(span),
                detokenizers=listening)
            group, reply = await self._submit(submission, context)
            outbox.detokenizer = reply.detokenizer
            if reply.detokenizer not in self.subscribed:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"detokenizer {reply.detokenizer} unavailable")
            while True:
                out = await outbox.get()
                if out.error:  # not marked finished: the abort below stops it wherever it still runs
                    await context.abort(grpc.StatusCode.UNAVAILABLE, out.error)
                finished = out.finished
                if metrics and out.token_ids:
                    now = time.monotonic()
                    if first_token:
                        metrics.ttft.observe(now - started)
                        first_token = False
                    else:  # merged outputs spread their gap over their tokens
                        for _ in out.token_ids:
                            metrics.itl.observe((now - last_token_at) / len(out.token_ids))
                    last_token_at = now
                    metrics.generation_tokens.inc(len(out.token_ids))
                if metrics and finished:
                    metrics.e2e.observe(time.monotonic() - started)
                    metrics.requests.labels(_FINISH_NAMES[out.finish_reason]).inc()
                if finished and out.usage is not None:
                    span.set_attributes({"gen_ai.usage.output_tokens": out.usage.completion_tokens,
                                         "gen_ai.response.finish_reasons": [_FINISH_NAMES[out.finish_reason]]})
                yield frontend_pb2.GenerateResponse(
                    request_id=request_id, text=out.text, token_ids=out.token_ids, logprobs=out.logprobs,
                    finish_reason=out.finish_reason, usage=out.usage)
                if finished:
                    return
        finally:
            self.in_flight -= 1
            del self.outboxes[key]
            if outbox.detokenizer in self.retired:
                self._close_if_idle(outbox.detokenizer)
            if group is not None:
                if not finished:  # the client went away or its deadline passed: abort everywhere
                    asyncio.get_running_loop().create_task(self._abort(group, request_id))
                else:
                    self.schedulers.release(group)

    async def _submit(self, submission: scheduler_pb2.SubmitRequestRequest,
                      context) -> tuple[SchedulerGroup, scheduler_pb2.SubmitRequestResponse]:
        """Submit to the least busy group; a group that is down or failed did not take the request,
        so the next one is tried. Aborts the RPC when no group takes it."""
        error: grpc.aio.AioRpcError | None = None
        for group in self.schedulers.candidates():
            remaining = context.time_remaining()
            timeout = min(SUBMIT_TIMEOUT_S, remaining) if remaining else SUBMIT_TIMEOUT_S
            self.schedulers.acquire(group)
            try:
                return group, await group.stub.SubmitRequest(submission, timeout=timeout)
            except grpc.aio.AioRpcError as exc:
                self.schedulers.release(group)
                error = exc
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    break
        if error is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no scheduler is available")
        code = error.code() if error.code() in _PASSED_THROUGH else grpc.StatusCode.UNAVAILABLE
        await context.abort(code, error.details() or "scheduler unavailable")

    async def _abort(self, group: SchedulerGroup, request_id: str) -> None:
        try:
            await group.stub.AbortRequest(scheduler_pb2.AbortRequestRequest(
                frontend_id=self.frontend_id, request_id=request_id), timeout=5)
        except grpc.aio.AioRpcError as exc:
            logger.warning("abort of %s failed: %s", request_id, exc.details())
        finally:
            self.schedulers.release(group)

    async def Tokenize(self, request, context):
        try:
            return frontend_pb2.TokenizeResponse(token_ids=self._encode(request.WhichOneof("input"), request))
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def GetModelInfo(self, request, context):
        return frontend_pb2.GetModelInfoResponse(model=self.limits.name, max_model_len=self.limits.max_model_len,
                                                 vocab_size=self.limits.vocab_size)

    async def drain(self) -> None:
        while self.in_flight:
            await asyncio.sleep(0.05)


async def serve(load_tokenizer, scheduler_specs: list[str], detokenizer_specs: list[str], host: str, port: int,
                ready_file: str | None, metrics_port: int | None = None,
                replica_refresh_interval_s: float = DEFAULT_REFRESH_INTERVAL_S) -> None:
    shell = ServiceShell("frontend", frontend_pb2.DESCRIPTOR.services_by_name["FrontendService"], host, port)
    servicer = FrontendServicer(None, scheduler_specs, detokenizer_specs, replica_refresh_interval_s)
    frontend_pb2_grpc.add_FrontendServiceServicer_to_server(servicer, shell.server)
    if registry := shell.metrics_registry(metrics_port, ready_file):
        servicer.metrics = FrontendMetrics(registry)

    async def warm_up() -> None:
        servicer.tokenizer = await asyncio.get_running_loop().run_in_executor(None, load_tokenizer)
        await servicer.connect()

    await shell.run(warm_up, servicer.drain, ready_file)
    await servicer.close()

