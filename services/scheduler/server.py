"""The scheduler's gRPC shell: takes requests and aborts, runs the engine-core scheduler and
keeps one ordered stream of step plans to each worker rank (up to `pipeline_depth` in flight).
Each step's tokens go to the detokenizer replicas through the DetokenizerRouter.

A request is known here by its *request key*, "{frontend_id}/{frontend_key}" (the core's
request_id); on the Execute stream by its worker handle (the core's), and on its replica's
stream by its stream handle (the router's)."""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from opentelemetry import trace
from prometheus_client import CollectorRegistry

from vmesh.services.common import telemetry
from vmesh.services.common.discovery import DEFAULT_REFRESH_INTERVAL_S, AddressBook, watch
from vmesh.services.common.grpc_server import ServiceShell, channel
from vmesh.services.common.metrics import Gauges, SchedulerMetrics
from vmesh.services.common.request_checks import check_prompt, check_resumed, decode_sampling
from vmesh.services.common.step_types import NewRequest, StepPlan
from vmesh.services.common.types import (
    PROMPT_TAIL_TOKENS,
    FinishReason,
    ModelLimits,
    RequestRef,
    StreamStart,
    TraceContext,
)
from vmesh.services.common.wire.step import plan_to_proto, result_from_proto
from vmesh.services.scheduler.block_pool import BlockPool
from vmesh.services.scheduler.detokenizer_router import DetokenizerRouter, OpenStream, Route, open_stream
from vmesh.services.scheduler.pipeline import StepPipeline
from vmesh.services.scheduler.request import Request
from vmesh.services.scheduler.scheduler import QueueFullError, RequestUpdate, Scheduler, SchedulerConfig
from vmesh.services.scheduler.settings import SchedulerSettings
from vmesh.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

WORKER_RETRY_S = 1.0  # between attempts to reach a lost worker again
# A request the worker was computing each of these many times it was lost is failed instead of
# computed again: it may be what kills the worker.
MAX_WORKER_LOSSES = 3
TRACER = telemetry.tracer("vmesh.scheduler")


@dataclass(kw_only=True)
class MeshSchedulerConfig(SchedulerSettings):
    """The scheduler's settings plus where its worker ranks and detokenizers are."""
    worker_addresses: list[str]
    detokenizer_addresses: list[str]  # host:port or dns:///name:port specs, re-resolved periodically
    max_num_seqs: int | None = None  # None: the worker's
    replica_refresh_interval_s: float = DEFAULT_REFRESH_INTERVAL_S


def request_key(frontend_id: str, frontend_key: int) -> str:
    """The scheduler's name for a request: unique across frontends."""
    return RequestRef(frontend_id, frontend_key).key


@dataclass
class _Lifetime:
    """A request's life in the scheduler, for its trace and vLLM's request histograms."""
    num_prompt_tokens: int
    submitted_at: float = 0.0  # monotonic
    admitted_at: float = 0.0  # first admission (monotonic); for the request histograms
    first_token_at: float = 0.0  # 0: no token yet
    num_generated: int = 0
    span: trace.Span = trace.INVALID_SPAN  # the request's life in the scheduler
    queue_span: trace.Span | None = None  # from submission to first admission
    worker_losses: int = 0  # times the worker was lost while computing it


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self, config: MeshSchedulerConfig, open_detokenizer_stream: OpenStream = open_stream):
        self.config = config
        self.scheduler: Scheduler | None = None
        # serve() marks the service NOT_SERVING (False) while the worker is lost, SERVING once back.
        self.on_serving: Callable[[bool], None] = lambda serving: None
        # The worker came back unlike before (another model, KV cache or limits): serve() exits the
        # process, so that its supervisor starts a scheduler that adopts the new worker.
        self.on_fatal: Callable[[str], None] = lambda reason: None
        self.recovering = False  # the worker is lost and waited for: submissions go elsewhere
        self.incarnation = uuid.uuid4().hex  # this process, as opposed to a restart on the same address
        self.limits: ModelLimits | None = None  # the workers' model, known once connected
        self.worker_calls: list[grpc.aio.StreamStreamCall] = []
        self.detokenizers = AddressBook(config.detokenizer_addresses)
        self.router = DetokenizerRouter(self._released_by_router, open_detokenizer_stream)
        self.lifetimes: dict[str, _Lifetime] = {}  # by request key; the requests the router has a route for
        self.wake = asyncio.Event()
        # Set while the worker is lost past its recovery timeout: submissions are refused.
        self.failure: str | None = None
        self.worker_failovers = 0  # times a lost worker's requests were recomputed on its replacement
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
        self._worker_stubs = []
        for address in self.config.worker_addresses:
            ch = channel(address, "worker")
            self._channels.append(ch)
            self._worker_stubs.append(worker_pb2_grpc.WorkerServiceStub(ch))
        info = self.info = await self._open_worker_streams(timeout=600)
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
        await self.router.connect(self.detokenizers.addresses)
        self._tasks.append(asyncio.create_task(watch(self.detokenizers, self.config.replica_refresh_interval_s,
                                                     self.router.replicas.update)))
        self._tasks.append(asyncio.create_task(self._engine_loop()))
        logger.info("connected to %d worker rank(s) (%d KV blocks of %d) and %d detokenizer(s)",
                    len(self.worker_calls), info.num_kv_blocks, info.block_size, len(self.router.replicas))

    async def _open_worker_streams(self, timeout: float) -> worker_pb2.GetWorkerInfoResponse:
        """Ask every rank for its model and KV cache, then open a new Execute stream to each (a
        new session: the worker forgets any earlier one). Returns rank 0's answer. A rank still
        loading its model answers UNAVAILABLE: it is asked again until `timeout`."""
        deadline = time.monotonic() + timeout
        infos = []
        for stub in self._worker_stubs:
            while True:
                try:
                    infos.append(await stub.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(), wait_for_ready=True,
                                                          timeout=max(0.1, deadline - time.monotonic())))
                    break
                except grpc.aio.AioRpcError as exc:
                    if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() + WORKER_RETRY_S > deadline:
                        raise
                    await asyncio.sleep(WORKER_RETRY_S)
        info = infos[0]
        if any(i.num_kv_blocks != info.num_kv_blocks or i.block_size != info.block_size for i in infos):
            raise RuntimeError("worker ranks disagree on their KV cache")
        group_sizes = {max(1, i.tensor_parallel_size) for i in infos}
        if group_sizes != {1} and group_sizes != {len(infos)}:
            # A rank left out never gets plans, and the others wait for it in every collective.
            raise RuntimeError(f"--workers names {len(infos)} worker(s), but they report tensor-parallel "
                               f"group sizes {sorted(group_sizes)}: name every rank of the group, rank 0 first")
        self.worker_calls = [stub.Execute() for stub in self._worker_stubs]
        return info

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.router.close()
        for ch in self._channels:
            await ch.close()

    # --- RPCs --------------------------------------------------------------------------------

    async def SubmitRequest(self, request, context):
        if self.failure:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.failure)
        if not self.accepting or self.scheduler is None or self.recovering:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the scheduler is not accepting requests")
        replicas = self.router.routable(request.detokenizers)
        if not replicas:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no detokenizer replica is reachable")
        key = request_key(request.frontend_id, request.frontend_key)
        try:
            # Checked here too, whoever sent it: a request the worker cannot serve would fail
            # the whole step, and with it every other request in the batch.
            check_prompt(request.prompt_token_ids, self.limits)
            sampling = decode_sampling(request.sampling, len(request.prompt_token_ids), self.limits)
            check_resumed(request.resumed_output_token_ids, sampling, self.limits)
            self.scheduler.add_request(Request(key, list(request.prompt_token_ids), sampling,
                                               priority=request.priority,
                                               output_token_ids=list(request.resumed_output_token_ids)))
        except QueueFullError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        replica = min(replicas, key=lambda r: r.outstanding)
        life = self.lifetimes[key] = _Lifetime(len(request.prompt_token_ids), submitted_at=time.monotonic())
        life.span = TRACER.start_span("scheduler.request", context=telemetry.from_proto(request.trace_context),
                                      attributes={"vmesh.prompt_tokens": len(request.prompt_token_ids),
                                                  "vmesh.detokenizer": replica.address,
                                                  "vmesh.resumed_output_tokens":
                                                      len(request.resumed_output_token_ids)})
        life.queue_span = TRACER.start_span("scheduler.queue", context=trace.set_span_in_context(life.span))
        self.router.open_route(key, replica, StreamStart(
            RequestRef(request.frontend_id, request.frontend_key), list(request.prompt_token_ids[-PROMPT_TAIL_TOKENS:]),
            sampling, len(request.prompt_token_ids),
            trace_context=telemetry.trace_context(life.span) if telemetry.tracing_enabled() else TraceContext(),
            resumed_output_token_ids=list(request.resumed_output_token_ids),
            resumed_text_length=request.resumed_text_length))
        self.wake.set()
        return scheduler_pb2.SubmitRequestResponse(detokenizer=replica.address)

    async def AbortRequest(self, request, context):
        key = request_key(request.frontend_id, request.frontend_key)
        aborted = self.scheduler is not None and self.scheduler.abort(key)
        route = self._release(key)
        if route is not None:
            self.router.add_end(route)
            await self.router.flush()
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
        while True:
            try:
                await self._run_steps()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                if not _worker_went_away(exc):
                    # The worker refused a plan (FAILED_PRECONDITION), another scheduler took it
                    # over (ABORTED), or a bug here: recomputing would only repeat it.
                    logger.error("the engine loop failed: %s", detail)
                    await self._fail_all("the worker serving this request failed")
                    return
                logger.error("worker unavailable: %s; %d request(s) wait for it to come back", detail,
                             len(self.router.routes))
                if not await self._recover_worker():
                    return

    async def _run_steps(self) -> None:
        pipeline = self.pipeline
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
            self._route(pipeline.complete(result_from_proto(results[0])))
            await self.router.flush()

    async def _recover_worker(self) -> bool:
        """Wait for the lost worker to answer again (restarted in place, by `vmesh serve` or
        Kubernetes) and recompute every request on it: clients see a pause. Past the recovery
        timeout the requests fail with UNAVAILABLE and submissions are refused, but the worker is
        still waited for; once it is back the scheduler serves again. False: it never can (the
        replacement's KV cache differs)."""
        for call in self.worker_calls:
            call.cancel()
        self.worker_calls = []
        self.pipeline.abandon_all()
        was_computing = {r.request_id for r in self._core().running}
        affected = self._core().recompute_all()
        self.worker_failovers += 1
        self.recovering = True
        self.on_serving(False)
        for request in affected:
            life = self.lifetimes.get(request.request_id)
            if life is None:
                continue
            life.span.add_event("vmesh.failover", {"vmesh.failover.kind": "worker"})
            if request.request_id in was_computing:
                life.worker_losses += 1
                if life.worker_losses >= MAX_WORKER_LOSSES:
                    logger.error("request %s was on the worker each of the %d times it was lost; failing it",
                                 request.request_id, life.worker_losses)
                    self._core().abort(request.request_id)
                    if (route := self._release(request.request_id)) is not None:
                        self.router.add_end(route, error="the worker failed each time it computed this request")
        await self.router.flush()
        deadline = time.monotonic() + self.config.worker_recovery_timeout_s
        lost_at = time.monotonic()
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 and self.failure is None:
                logger.error("the worker did not come back within %.0f s; failing %d request(s)",
                             self.config.worker_recovery_timeout_s, len(self.router.routes))
                await self._fail_all("the worker serving this request became unavailable")
            try:
                info = await self._open_worker_streams(timeout=remaining if remaining > 0 else WORKER_RETRY_S)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                logger.info("worker not reachable yet (%s)", detail)
                await asyncio.sleep(WORKER_RETRY_S)  # an attempt that failed at once is not repeated at once
                continue
            if info != self.info:
                # Its model, KV cache or limits changed (e.g. a GPU's free memory sized the cache):
                # a new scheduler process adopts it; the frontends fail this one's requests over.
                reason = f"the worker came back unlike before ({_worker_geometry(info)}, was " \
                         f"{_worker_geometry(self.info)}); restarting the scheduler"
                logger.error("%s", reason)
                self.on_fatal(reason)
                return False
            if time.monotonic() - lost_at < WORKER_RETRY_S:  # lost and back at once: no hot loop
                await asyncio.sleep(WORKER_RETRY_S)
            logger.warning("worker back after %.1f s; recomputing %d request(s)", time.monotonic() - lost_at,
                           len(self._core().requests))
            self.failure = None
            self.recovering = False
            self.on_serving(self.accepting)  # a scheduler draining meanwhile stays NOT_SERVING
            self.wake.set()
            return True

    async def _fail_all(self, message: str) -> None:
        """End every request this scheduler holds with `message` (UNAVAILABLE to the client) and
        refuse new ones."""
        self.failure = message
        for key in list(self.router.routes):
            self._core().abort(key)
            if (route := self._release(key)) is not None:
                self.router.add_end(route, error=message)
        await self.router.flush()
        self.on_serving(False)

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
            "vmesh:worker_failovers": ("counter", "Times the worker was lost and its requests recomputed on its "
                                                  "replacement.", self.worker_failovers),
            "vmesh:detokenizer_replicas_routable": (
                "gauge", "Detokenizer replicas connected and taking new requests.",
                len(self.router.routable())),
        }

    def _core(self) -> Scheduler:
        """The scheduler core, which exists once the workers have answered."""
        if self.scheduler is None:
            raise RuntimeError("the scheduler core is used before the workers answered")
        return self.scheduler

    def _plan_message(self, plan: StepPlan) -> worker_pb2.ExecuteRequest:
        message = self._plan_to_proto(plan)
        for new in message.new_requests:  # requests entering the worker carry their trace context
            life = self.lifetimes.get(self._core().by_handle[new.handle].request_id)  # by worker handle
            if life is None:
                continue
            if life.queue_span is not None:  # first admission
                life.queue_span.end()
                life.queue_span = None
                life.admitted_at = time.monotonic()
                if self.metrics:
                    self.metrics.queue_time.observe(life.admitted_at - life.submitted_at)
                    self.metrics.prompt_tokens.inc(life.num_prompt_tokens)
            if telemetry.tracing_enabled():
                new.trace_context.CopyFrom(telemetry.to_proto(life.span))
        return message

    def _plan_to_proto(self, plan: StepPlan) -> worker_pb2.ExecuteRequest:
        if not self.config.stateless_worker:
            return plan_to_proto(plan)
        # V0 behaviour: every scheduled request travels in full, every step.
        full = StepPlan(step=plan.step, scheduled_handles=plan.scheduled_handles,
                        num_scheduled_tokens=plan.num_scheduled_tokens)
        for worker_handle, n in zip(plan.scheduled_handles, plan.num_scheduled_tokens):
            r = self._core().by_handle[worker_handle]
            full.new_requests.append(NewRequest(worker_handle, r.all_token_ids, len(r.prompt_token_ids), r.sampling,
                                                list(r.block_ids), r.num_computed_tokens - n))
        return plan_to_proto(full, full_state=True)

    # --- routing to detokenizers -------------------------------------------------------------

    def _route(self, updates: list[RequestUpdate]) -> None:
        now = time.monotonic()  # one clock read per step, not per request
        generated = 0
        for update in updates:
            route = self.router.routes.get(update.request_id)
            if route is None:
                continue
            life = self.lifetimes[update.request_id]
            if num_new := len(update.new_token_ids):
                generated += num_new
                life.num_generated += num_new
                if not life.first_token_at:
                    life.first_token_at = now
            self.router.add_update(route, update)
            if update.finish_reason is not None:
                self._release(update.request_id, update.finish_reason.value)
                if self.metrics:
                    self._observe_finished(self.metrics, life, now)
        if self.metrics and generated:
            self.metrics.generation_tokens.inc(generated)

    @staticmethod
    def _observe_finished(m: SchedulerMetrics, life: _Lifetime, now: float) -> None:
        """vLLM's per-request histograms, for a request the engine finished (not one aborted from outside)."""
        m.request_prompt_tokens.observe(life.num_prompt_tokens)
        m.request_generation_tokens.observe(life.num_generated)
        m.inference_time.observe(now - life.admitted_at)
        if life.first_token_at:  # a request can end without a token (e.g. an engine-side abort)
            m.prefill_time.observe(life.first_token_at - life.admitted_at)
            m.decode_time.observe(now - life.first_token_at)

    def _release(self, key: str, finish_reason: str = FinishReason.ABORT.value) -> Route | None:
        """Close the request's route and end its trace; None if it has none (already released)."""
        route = self.router.close_route(key)
        self._end_lifetime(key, finish_reason)
        return route

    def _end_lifetime(self, key: str, finish_reason: str) -> None:
        if (life := self.lifetimes.pop(key, None)) is not None:
            if life.queue_span is not None:
                life.queue_span.end()
            life.span.set_attribute("vmesh.finish_reason", finish_reason)
            life.span.end()

    def _released_by_router(self, key: str, reason: FinishReason) -> None:
        """A stop string, an orphan or a lost replica: the router has closed the route already."""
        self._core().abort(key, reason)
        self._end_lifetime(key, reason.value)

    async def drain(self) -> None:
        self.accepting = False
        while self.scheduler is not None and self.scheduler.has_unfinished() and not self.failure:
            await asyncio.sleep(0.05)


def _worker_went_away(exc: Exception) -> bool:
    """Whether an Execute stream failed because its worker went (died, restarted, unreachable),
    which a replacement can recover from, as opposed to a refusal or a bug."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code() == grpc.StatusCode.UNAVAILABLE
    return isinstance(exc, ConnectionError)  # the worker closed its stream (it drained and exited)


def _worker_geometry(info: worker_pb2.GetWorkerInfoResponse) -> str:
    return (f"{info.model_name}, {info.num_kv_blocks} KV blocks of {info.block_size}, max_model_len "
            f"{info.max_model_len}, max_num_seqs {info.max_num_seqs}")


async def serve(config: MeshSchedulerConfig, host: str, port: int, ready_file: str | None,
                metrics_port: int | None = None) -> None:
    shell = ServiceShell("scheduler", scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"], host, port)
    servicer = SchedulerServicer(config)
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(servicer, shell.server)
    servicer.metrics_registry = shell.metrics_registry(metrics_port, ready_file)

    def on_serving(serving: bool) -> None:
        asyncio.get_running_loop().create_task(shell.set_serving(serving))

    def on_fatal(reason: str) -> None:
        logging.shutdown()
        os._exit(3)

    servicer.on_serving = on_serving
    servicer.on_fatal = on_fatal
    await shell.run(servicer.connect, servicer.drain, ready_file)
    await servicer.close()
