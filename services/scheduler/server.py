"""The scheduler's gRPC shell: takes requests and aborts, runs the engine-core scheduler,
keeps one ordered stream of step plans to each worker rank (up to `pipeline_depth` in
flight) and one stream of token batches to each detokenizer replica."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from dataclasses import dataclass, field

import grpc
from opentelemetry import trace
from prometheus_client import CollectorRegistry

from services.common import telemetry, wire
from services.common.discovery import DEFAULT_REFRESH_INTERVAL_S, AddressBook, watch
from services.common.grpc_server import ServiceShell, channel
from services.common.metrics import Gauges, SchedulerMetrics
from services.common.request_checks import ModelLimits, check_request
from services.common.step_types import NewRequest, StepPlan
from services.scheduler.block_pool import BlockPool
from services.scheduler.pipeline import StepPipeline
from services.scheduler.request import FinishReason, Request
from services.scheduler.scheduler import QueueFullError, RequestUpdate, Scheduler, SchedulerConfig
from vmesh.v1 import (
    common_pb2,
    detokenizer_pb2,
    detokenizer_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

logger = logging.getLogger(__name__)

PROMPT_TAIL_TOKENS = 4  # decoding context given to the detokenizer
RECONNECT_DELAY_S = 1.0
TRACER = telemetry.tracer("vmesh.scheduler")


@dataclass
class MeshSchedulerConfig:
    worker_addresses: list[str]
    detokenizer_addresses: list[str]  # host:port or dns:///name:port specs, re-resolved periodically
    max_num_batched_tokens: int = 2048
    max_num_seqs: int | None = None  # None: the worker's
    policy: str = "fcfs"
    pipeline_depth: int = 2
    stateless_worker: bool = False
    enable_prefix_caching: bool = True
    max_waiting: int = 4096
    replica_refresh_interval_s: float = DEFAULT_REFRESH_INTERVAL_S


@dataclass
class _Route:
    handle: int  # the request's number on its detokenizer stream
    replica: _Replica
    frontend_id: str
    frontend_key: int
    prompt_tail: list[int]
    sampling: common_pb2.SamplingParams
    num_prompt_tokens: int
    introduced: bool = False
    submitted_at: float = 0.0  # monotonic
    admitted_at: float = 0.0  # first admission (monotonic); for the request histograms
    first_token_at: float = 0.0  # 0: no token yet
    num_generated: int = 0
    span: trace.Span = trace.INVALID_SPAN  # the request's life in the scheduler
    queue_span: trace.Span | None = None  # from submission to first admission


@dataclass
class _Replica:
    """One detokenizer replica and the stream to it. A lost stream is reopened (the replica may
    have restarted); a replica whose address leaves the list takes no new requests and is closed
    once its last request ends."""
    address: str
    call: grpc.aio.StreamStreamCall | None = None
    alive: bool = False  # the stream is open: new requests may be routed here
    draining: bool = False  # the replica is shutting down (it said so): no new requests
    retired: bool = False  # its address left the list
    outstanding: int = 0
    connected: asyncio.Event = field(default_factory=asyncio.Event)  # set on the first connection (or retirement)
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None
    pending: detokenizer_pb2.DetokenizeRequest = field(default_factory=detokenizer_pb2.DetokenizeRequest)
    # A gRPC stream takes one write at a time (a second one in flight fails the call with TOO_MANY_OPERATIONS),
    # and abort RPCs flush concurrently with the engine loop. The lock's FIFO wake-up keeps batches in order.
    write_lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self, config: MeshSchedulerConfig):
        self.config = config
        self.scheduler: Scheduler | None = None
        self.incarnation = uuid.uuid4().hex  # this process, as opposed to a restart on the same address
        self.limits: ModelLimits | None = None  # the workers' model, known once connected
        self.worker_calls: list[grpc.aio.StreamStreamCall] = []
        self.detokenizers = AddressBook(config.detokenizer_addresses)
        self.replicas: dict[str, _Replica] = {}
        self.routes: dict[str, _Route] = {}
        self.key_of_handle: dict[int, str] = {}
        self._route_handles = itertools.count()
        self.wake = asyncio.Event()
        self.failure: str | None = None  # set once a worker is lost: the scheduler stops serving
        self.accepting = True
        self.steps = 0
        self.plan_bytes = 0
        self.decode_steps = 0
        self.decode_plan_bytes = 0
        self._tasks: list[asyncio.Task] = []
        self._channels: list[grpc.aio.Channel] = []
        self.metrics: SchedulerMetrics | None = None
        self.metrics_registry: CollectorRegistry | None = None  # metrics are created at connect, labelled by model

    # --- start-up ----------------------------------------------------------------------------

    async def connect(self) -> None:
        infos = []
        for address in self.config.worker_addresses:
            ch = channel(address, "worker")
            self._channels.append(ch)
            stub = worker_pb2_grpc.WorkerServiceStub(ch)
            infos.append(await stub.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(), wait_for_ready=True, timeout=600))
            self.worker_calls.append(stub.Execute())
        info = infos[0]
        if any(i.num_kv_blocks != info.num_kv_blocks or i.block_size != info.block_size for i in infos):
            raise RuntimeError("worker ranks disagree on their KV cache")
        self.info = info
        self.limits = ModelLimits(info.model_name, info.max_model_len, info.vocab_size)
        if self.metrics_registry is not None and self.metrics is None:
            # Only now is the model known: every series carries its name, as vLLM's do.
            self.metrics = SchedulerMetrics(self.metrics_registry, info.model_name, info.max_model_len,
                                            self.config.max_num_batched_tokens)
            self.metrics_registry.register(Gauges(self.gauges, info.model_name))
        pool = BlockPool(info.num_kv_blocks, info.block_size, self.config.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(
            max_model_len=info.max_model_len, max_num_seqs=min(self.config.max_num_seqs or info.max_num_seqs,
                                                               info.max_num_seqs),
            max_num_batched_tokens=self.config.max_num_batched_tokens, policy=self.config.policy,
            max_waiting=self.config.max_waiting), pool, tuple(info.eos_token_ids))
        self.pipeline = StepPipeline(self.scheduler, self.config.pipeline_depth)
        self._replicas_changed(self.detokenizers.addresses, [])
        await asyncio.gather(*(r.connected.wait() for r in self.replicas.values()))
        self._tasks.append(asyncio.create_task(watch(self.detokenizers, self.config.replica_refresh_interval_s,
                                                     self._replicas_changed)))
        self._tasks.append(asyncio.create_task(self._engine_loop()))
        logger.info("connected to %d worker rank(s) (%d KV blocks of %d) and %d detokenizer(s)",
                    len(self.worker_calls), info.num_kv_blocks, info.block_size, len(self.replicas))

    async def close(self) -> None:
        for task in [*self._tasks, *(r.task for r in self.replicas.values() if r.task)]:
            task.cancel()
        for ch in self._channels:
            await ch.close()

    # --- RPCs --------------------------------------------------------------------------------

    async def SubmitRequest(self, request, context):
        if self.failure:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.failure)
        if not self.accepting or self.scheduler is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the scheduler is not accepting requests")
        replicas = [r for r in self.replicas.values() if r.alive and not r.draining and not r.retired
                    and (not request.detokenizers or r.address in request.detokenizers)]
        if not replicas:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no detokenizer replica is reachable")
        key = _key(request.frontend_id, request.request_id)
        sampling = wire.sampling_from_proto(request.sampling)
        try:
            # Checked here too, whoever sent it: a request the worker cannot serve would fail
            # the whole step, and with it every other request in the batch.
            check_request(request.prompt_token_ids, sampling, self.limits)
            self.scheduler.add_request(Request(key, list(request.prompt_token_ids), sampling,
                                               priority=request.priority))
        except QueueFullError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        replica = min(replicas, key=lambda r: r.outstanding)
        replica.outstanding += 1
        route = self.routes[key] = _Route(next(self._route_handles), replica, request.frontend_id,
                                          request.frontend_key, list(request.prompt_token_ids[-PROMPT_TAIL_TOKENS:]),
                                          request.sampling, len(request.prompt_token_ids))
        route.span = TRACER.start_span("scheduler.request", context=telemetry.from_proto(request.trace_context),
                                       attributes={"vmesh.prompt_tokens": len(request.prompt_token_ids),
                                                   "vmesh.detokenizer": replica.address})
        route.queue_span = TRACER.start_span("scheduler.queue", context=trace.set_span_in_context(route.span))
        route.submitted_at = time.monotonic()
        self.key_of_handle[route.handle] = key
        self.wake.set()
        return scheduler_pb2.SubmitRequestResponse(detokenizer=replica.address)

    async def AbortRequest(self, request, context):
        key = _key(request.frontend_id, request.request_id)
        aborted = self.scheduler is not None and self.scheduler.abort(key)
        route = self._pop_route(key)
        if route is not None:
            self._end_route(route)
            await self._flush_replicas()
        return scheduler_pb2.AbortRequestResponse(aborted=aborted)

    async def GetSchedulerStats(self, request, context):
        if self.scheduler is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "not connected to a worker yet")
        s = self.scheduler.stats()
        return scheduler_pb2.GetSchedulerStatsResponse(
            num_running=s.num_running, num_waiting=s.num_waiting, num_used_blocks=s.num_blocks - s.num_free_blocks,
            num_free_blocks=s.num_free_blocks, num_blocks=s.num_blocks, prefix_cache_queries=s.prefix_queries,
            prefix_cache_hits=s.prefix_hits, num_preemptions=s.num_preemptions, steps=self.steps,
            plan_bytes_sent=self.plan_bytes, pipeline_depth=self.config.pipeline_depth,
            stateless_worker=self.config.stateless_worker, model_name=self.info.model_name,
            max_model_len=self.scheduler.max_model_len, vocab_size=self.info.vocab_size,
            decode_steps=self.decode_steps, decode_plan_bytes=self.decode_plan_bytes, incarnation=self.incarnation)

    async def ResetPrefixCache(self, request, context):
        if self.scheduler is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "not connected to a worker yet")
        return scheduler_pb2.ResetPrefixCacheResponse(num_dropped_blocks=self.scheduler.reset_prefix_cache())

    # --- the engine loop ---------------------------------------------------------------------

    async def _engine_loop(self) -> None:
        pipeline = self.pipeline
        try:
            while True:
                for plan in pipeline.plans():
                    message = self._plan_message(plan)
                    if self.metrics and plan.scheduled_handles:
                        self.metrics.iteration_tokens.observe(plan.total_scheduled_tokens)
                    size = message.ByteSize()
                    self.plan_bytes += size
                    self.steps += 1
                    if not plan.new_requests and all(n == 1 for n in plan.num_scheduled_tokens):
                        self.decode_steps += 1
                        self.decode_plan_bytes += size
                    for call in self.worker_calls:
                        await call.write(message)
                if pipeline.idle:
                    self.wake.clear()
                    await self.wake.wait()
                    continue
                results = [await call.read() for call in self.worker_calls]
                if any(r is grpc.aio.EOF for r in results):
                    raise ConnectionError("a worker closed its stream")
                self._route(pipeline.complete(wire.result_from_proto(results[0])))
                await self._flush_replicas()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a lost worker: every request fails, the scheduler stops serving
            detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            # What clients read: the gist, not gRPC's text (it names internal addresses).
            self.failure = "the worker serving this request became unavailable"
            logger.error("worker unavailable: %s; failing %d request(s)", detail, len(self.routes))
            for key in list(self.routes):
                self.scheduler.abort(key)
                self._end_route(self._pop_route(key), error=self.failure)
            await self._flush_replicas()
            self.on_failure()

    def gauges(self) -> dict[str, tuple[str, str, float]]:
        if self.scheduler is None:
            return {}
        s = self.scheduler.stats()
        return {
            "vmesh:num_requests_running": ("gauge", "Requests in the running set.", s.num_running),
            "vmesh:num_requests_waiting": ("gauge", "Requests waiting to be admitted.", s.num_waiting),
            "vmesh:kv_cache_usage_perc": ("gauge", "Fraction of KV blocks in use (1 = full).", s.kv_usage),
            "vmesh:prefix_cache_queries": ("counter", "KV blocks looked up in the prefix cache.", s.prefix_queries),
            "vmesh:prefix_cache_hits": ("counter", "KV blocks found in the prefix cache.", s.prefix_hits),
            "vmesh:num_preemptions": ("counter", "Requests preempted (recomputed later).", s.num_preemptions),
            "vmesh:scheduler_steps": ("counter", "Step plans sent to the workers.", self.steps),
            "vmesh:plan_bytes": ("counter", "Serialized plan bytes sent per worker rank.", self.plan_bytes),
            "vmesh:detokenizer_replicas_routable": (
                "gauge", "Detokenizer replicas connected and taking new requests.",
                sum(r.alive and not r.draining and not r.retired for r in self.replicas.values())),
        }

    def on_failure(self) -> None:
        """Overridden by serve(): mark the service NOT_SERVING."""

    def _plan_message(self, plan: StepPlan) -> worker_pb2.ExecuteRequest:
        message = self._plan_to_proto(plan)
        for new in message.new_requests:  # requests entering the worker carry their trace context
            route = self.routes.get(self.scheduler.by_handle[new.handle].request_id)
            if route is None:
                continue
            if route.queue_span is not None:  # first admission
                route.queue_span.end()
                route.queue_span = None
                route.admitted_at = time.monotonic()
                if self.metrics:
                    self.metrics.queue_time.observe(route.admitted_at - route.submitted_at)
                    self.metrics.prompt_tokens.inc(route.num_prompt_tokens)
            if telemetry.tracing_enabled():
                new.trace_context.CopyFrom(telemetry.to_proto(route.span))
        return message

    def _plan_to_proto(self, plan: StepPlan) -> worker_pb2.ExecuteRequest:
        if not self.config.stateless_worker:
            return wire.plan_to_proto(plan)
        # V0 behaviour: every scheduled request travels in full, every step.
        full = StepPlan(step=plan.step, scheduled_handles=plan.scheduled_handles,
                        num_scheduled_tokens=plan.num_scheduled_tokens)
        for handle, n in zip(plan.scheduled_handles, plan.num_scheduled_tokens):
            r = self.scheduler.by_handle[handle]
            full.new_requests.append(NewRequest(handle, r.all_token_ids, len(r.prompt_token_ids), r.sampling,
                                                list(r.block_ids), r.num_computed_tokens - n))
        return wire.plan_to_proto(full, full_state=True)

    # --- routing to detokenizers -------------------------------------------------------------

    def _route(self, updates: list[RequestUpdate]) -> None:
        now = time.monotonic()  # one clock read per step, not per request
        generated = 0
        for update in updates:
            route = self.routes.get(update.request_id)
            if route is None:
                continue
            num_new = len(update.new_token_ids)
            if num_new:
                generated += num_new
                route.num_generated += num_new
                if not route.first_token_at:
                    route.first_token_at = now
            batch = route.replica.pending
            self._introduce(route)
            batch.handles.append(route.handle)
            batch.num_tokens.append(num_new)
            batch.token_ids.extend(update.new_token_ids)
            batch.finish_reasons.append(wire.FINISH_REASONS_PB[update.finish_reason])
            batch.num_cached_prompt_tokens.append(update.num_cached_prompt_tokens)
            batch.errors.append("")
            for lp in update.logprobs:
                batch.logprobs_handles.append(route.handle)
                batch.sampled_logprobs.append(lp.logprob)
                batch.sampled_ranks.append(lp.rank)
                batch.num_top.append(len(lp.top_token_ids))
                batch.top_token_ids.extend(lp.top_token_ids)
                batch.top_logprobs.extend(lp.top_logprobs)
            if update.finish_reason is not None:
                self._pop_route(update.request_id, update.finish_reason.value)
                if self.metrics:
                    self._observe_finished(self.metrics, route, now)
        if self.metrics and generated:
            self.metrics.generation_tokens.inc(generated)

    @staticmethod
    def _observe_finished(m: SchedulerMetrics, route: _Route, now: float) -> None:
        """vLLM's per-request histograms, for a request the engine finished (not one aborted from outside)."""
        m.request_prompt_tokens.observe(route.num_prompt_tokens)
        m.request_generation_tokens.observe(route.num_generated)
        m.inference_time.observe(now - route.admitted_at)
        if route.first_token_at:  # a request can end without a token (e.g. an engine-side abort)
            m.prefill_time.observe(route.first_token_at - route.admitted_at)
            m.decode_time.observe(now - route.first_token_at)

    def _pop_route(self, key: str, finish_reason: str = "abort") -> _Route | None:
        route = self.routes.pop(key, None)
        if route is not None:
            del self.key_of_handle[route.handle]
            route.replica.outstanding -= 1
            if route.queue_span is not None:
                route.queue_span.end()
            route.span.set_attribute("vmesh.finish_reason", finish_reason)
            route.span.end()
        return route

    def _introduce(self, route: _Route) -> None:
        if route.introduced:
            return
        route.replica.pending.new_requests.append(detokenizer_pb2.DetokenizerRequestInfo(
            handle=route.handle, frontend_id=route.frontend_id, frontend_key=route.frontend_key,
            prompt_tail=route.prompt_tail, sampling=route.sampling, num_prompt_tokens=route.num_prompt_tokens,
            trace_context=telemetry.to_proto(route.span) if telemetry.tracing_enabled() else None))
        route.introduced = True

    def _end_route(self, route: _Route, error: str = "") -> None:
        """Tell a popped request's replica that it ended without more tokens (aborted or failed)."""
        self._introduce(route)
        batch = route.replica.pending
        batch.handles.append(route.handle)
        batch.num_tokens.append(0)
        batch.finish_reasons.append(wire.FINISH_REASONS_PB[FinishReason.ABORT])
        batch.num_cached_prompt_tokens.append(0)
        batch.errors.append(error)

    async def _flush_replicas(self) -> None:
        for replica in list(self.replicas.values()):
            batch = replica.pending
            if batch.handles or batch.new_requests:
                replica.pending = detokenizer_pb2.DetokenizeRequest()
                async with replica.write_lock:
                    if replica.alive:
                        try:
                            await replica.call.write(batch)
                        except Exception as exc:
                            self._replica_lost(replica, exc)
            self._close_if_idle(replica)  # a retired replica goes once its last outputs are out

    # --- detokenizer replicas ----------------------------------------------------------------

    def _replicas_changed(self, joined: list[str], left: list[str]) -> None:
        for address in joined:
            replica = self.replicas.get(address)
            if replica is not None:  # it left and came back before its last request ended
                replica.retired = False
                continue
            replica = self.replicas[address] = _Replica(address)
            replica.task = asyncio.create_task(self._keep_replica(replica))
        for address in left:
            if (replica := self.replicas.get(address)) is not None:
                replica.retired = True
                replica.connected.set()
                self._close_if_idle(replica)

    def _close_if_idle(self, replica: _Replica) -> None:
        idle = replica.outstanding == 0 and not replica.pending.handles and not replica.pending.new_requests
        if replica.retired and idle and self.replicas.get(replica.address) is replica:
            del self.replicas[replica.address]
            replica.alive = False
            if replica.task is not None:
                replica.task.cancel()
            logger.info("detokenizer %s left", replica.address)

    def _open_stream(self, address: str) -> tuple[grpc.aio.StreamStreamCall, grpc.aio.Channel]:
        ch = channel(address, "detokenizer")
        return detokenizer_pb2_grpc.DetokenizerServiceStub(ch).Detokenize(wait_for_ready=True), ch

    async def _keep_replica(self, replica: _Replica) -> None:
        """Hold a stream open to the replica; reopen it after a loss until the replica leaves."""
        while True:
            call, ch = self._open_stream(replica.address)
            reader = None
            try:
                await call.wait_for_connection()  # the replica sends initial metadata on a new stream
                replica.lost.clear()
                async with replica.write_lock:  # not while a write to the previous stream is in flight
                    replica.call = call
                    replica.alive = True
                    replica.draining = False  # a restarted replica; one still draining says so again at once
                replica.connected.set()
                logger.info("detokenizer %s connected", replica.address)
                reader = asyncio.create_task(self._read_replica(replica, call))
                await replica.lost.wait()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._replica_lost(replica, exc)
            finally:
                if reader is not None:
                    reader.cancel()
                call.cancel()
                await ch.close()
            await asyncio.sleep(RECONNECT_DELAY_S)

    async def _read_replica(self, replica: _Replica, call: grpc.aio.StreamStreamCall) -> None:
        try:
            while True:
                response = await call.read()
                if response is grpc.aio.EOF:
                    raise ConnectionError("stream closed")
                if response.draining and not replica.draining:
                    replica.draining = True
                    logger.info("detokenizer %s is draining; routing no new requests to it", replica.address)
                # A stop string matched, or the owning frontend went away: either way the
                # detokenizer has already let the request go.
                for handles, reason in ((response.stopped_handles, FinishReason.STOP),
                                        (response.orphaned_handles, FinishReason.ABORT)):
                    for handle in handles:
                        if (key := self.key_of_handle.get(handle)) is not None:
                            self.scheduler.abort(key, reason)
                            self._pop_route(key, reason.value)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._replica_lost(replica, exc)

    def _replica_lost(self, replica: _Replica, exc: Exception) -> None:
        """Abort the replica's requests; the replica tells their frontends (or their subscriptions
        break, when the replica itself is gone). `_keep_replica` reconnects."""
        replica.lost.set()
        if not replica.alive:
            return
        replica.alive = False
        replica.pending = detokenizer_pb2.DetokenizeRequest()  # nothing in it can reach anyone now
        lost = [key for key, route in self.routes.items() if route.replica is replica]
        logger.error("detokenizer %s lost (%s); aborting its %d request(s)", replica.address, exc, len(lost))
        for key in lost:
            self.scheduler.abort(key)
            self._pop_route(key)
        self._close_if_idle(replica)

    async def drain(self) -> None:
        self.accepting = False
        while self.scheduler is not None and self.scheduler.has_unfinished() and not self.failure:
            await asyncio.sleep(0.05)


def _key(frontend_id: str, request_id: str) -> str:
    return f"{frontend_id}/{request_id}"


async def serve(config: MeshSchedulerConfig, host: str, port: int, ready_file: str | None,
                metrics_port: int | None = None) -> None:
    shell = ServiceShell("scheduler", scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"], host, port)
    servicer = SchedulerServicer(config)
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(servicer, shell.server)
    servicer.metrics_registry = shell.metrics_registry(metrics_port, ready_file)

    def on_failure() -> None:
        asyncio.get_running_loop().create_task(shell.set_serving(False))

    servicer.on_failure = on_failure
    await shell.run(servicer.connect, servicer.drain, ready_file)
    await servicer.close()
