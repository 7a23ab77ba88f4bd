"""The scheduler's gRPC shell: its RPCs (submissions, aborts, stats) and its metrics over one
SchedulerSession (services/scheduler/session.py), which runs the engine loop.

A request is known here by its *request key*, "{frontend_id}/{frontend_key}" (the core's
request_id)."""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import Callable, Iterator

import grpc
from opentelemetry import trace
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from vmesh.services.common import telemetry
from vmesh.services.common.admission import InvalidRequest, admit, check_adapter
from vmesh.services.common.grpc_server import ServiceShell
from vmesh.services.common.metrics import SchedulerMetrics, ScrapedMetrics
from vmesh.services.common.resume import NothingToResume, ResumeRefused
from vmesh.services.common.server_settings import ServerSettings
from vmesh.services.common.types import PROMPT_TAIL_TOKENS, RequestRef, SamplingParams, StreamStart, TraceContext
from vmesh.services.common.wire.cache import cache_update_to_proto
from vmesh.services.common.wire.sampling import sampling_from_proto
from vmesh.services.scheduler.cache_feed import CacheFeed, WatcherDropped
from vmesh.services.scheduler.detokenizer_router import open_stream
from vmesh.services.scheduler.lora_admin import LoraChangeRefused, load_adapter, unload_adapter
from vmesh.services.scheduler.lora_metrics import LoraRequestsInfo
from vmesh.services.scheduler.request import Request
from vmesh.services.scheduler.scheduler import QueueFullError
from vmesh.services.scheduler.session import SchedulerSession
from vmesh.services.scheduler.settings import SchedulerServiceSettings
from vmesh.services.scheduler.speculation import SpecDecodeStats
from vmesh.services.scheduler.worker_ranks import open_worker
from vmesh.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

logger = logging.getLogger(__name__)


def request_key(frontend_id: str, frontend_key: int) -> str:
    """The scheduler's name for a request: unique across frontends."""
    return RequestRef(frontend_id, frontend_key).key


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self, session: SchedulerSession):
        self.session = session
        self.incarnation = uuid.uuid4().hex  # this process, as opposed to a restart on the same address
        self.metrics_registry: CollectorRegistry | None = None  # metrics are created at connect, labelled by model
        self.cache_feed: CacheFeed | None = None  # once the core exists (connect)

    async def connect(self) -> None:
        info = await self.session.connect_workers()
        if self.metrics_registry is not None and self.session.metrics is None:
            # Only now is the model known: every series carries its name, as vLLM's do.
            self.session.set_metrics(SchedulerMetrics(self.metrics_registry, info.model_name, info.max_model_len,
                                                      self.session.settings.max_num_batched_tokens))
            self.metrics_registry.register(ScrapedMetrics(self.scraped_metrics, info.model_name))
            self.metrics_registry.register(AcceptedPerPosition(self.spec_stats, info.model_name))
            self.metrics_registry.register(LoraRequestsInfo(lambda: self.session.scheduler, info.model_name))
        await self.session.start()
        self.cache_feed = CacheFeed(self.session.core(), self.incarnation)
        self.session.spawn(self.cache_feed.run())

    async def SubmitRequest(self, request, context):
        session = self.session
        if (refusal := session.unavailable()) is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, refusal)
        replicas = session.router.routable(request.detokenizers)
        if not replicas:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no detokenizer replica is reachable")
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:  # its sender has given up on it: queued, it would run for nobody
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the submission's deadline passed before it "
                                                                    "was queued")
        key = request_key(request.frontend_id, request.frontend_key)
        if key in session.core().requests:  # its first claim is untouched: refused, not a failure of the step
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {key} is already submitted")
        try:
            sampling = self._admit(key, request)
        except QueueFullError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except InvalidRequest as exc:  # only the request's fault: any other error is the scheduler's
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        replica = min(replicas, key=lambda r: r.outstanding)
        life = session.lifetimes.begin(key, len(request.prompt_token_ids),
                                       telemetry.from_message(request.trace_context),
                                       {"vmesh.prompt_tokens": len(request.prompt_token_ids),
                                        "vmesh.detokenizer": replica.address,
                                        "vmesh.resumed_output_tokens": len(request.resumed_output_token_ids)})
        session.router.open_route(key, replica, _introduction(request, sampling, life.span))
        session.wake.set()
        return scheduler_pb2.SubmitRequestResponse(detokenizer=replica.address)

    def _admit(self, key: str, request: scheduler_pb2.SubmitRequestRequest) -> SamplingParams:
        """Queue the request in the core. Checked here too, whoever sent it: a request the worker
        cannot serve would fail the whole step, and with it every other request in the batch."""
        sampling = sampling_from_proto(request.sampling)
        admit(request.prompt_token_ids, sampling, self.session.model_limits(), request.resumed_output_token_ids)
        check_adapter(request.lora_name, self.session.lora_adapters)
        queued = Request(key, list(request.prompt_token_ids), sampling, priority=request.priority,
                         output_token_ids=list(request.resumed_output_token_ids), lora_name=request.lora_name,
                         resume_key=request.resume_key, prompt_digest=request.prompt_digest)
        self.session.core().add_request(queued)
        self.session.add_resumable(queued)
        return sampling

    async def AbortRequest(self, request, context):
        aborted = await self.session.abort(request_key(request.frontend_id, request.frontend_key))
        return scheduler_pb2.AbortRequestResponse(aborted=aborted)

    async def TakeOverRequest(self, request, context):
        if self.session.scheduler is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "not connected to a worker yet")
        try:
            tokens = await self.session.take_over(request.resume_key, request.prompt_digest,
                                                  request.num_output_tokens)
        except NothingToResume:
            await context.abort(grpc.StatusCode.NOT_FOUND, "this group holds no request under that resume key")
        except ResumeRefused as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return scheduler_pb2.TakeOverRequestResponse(output_token_ids=tokens)

    async def GetSchedulerStats(self, request, context):
        session = self.session
        if session.scheduler is None or session.info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "not connected to a worker yet")
        s, sent, settings = session.scheduler.stats(), session.workers.traffic, session.settings
        spec = session.scheduler.spec_stats
        return scheduler_pb2.GetSchedulerStatsResponse(
            num_running=s.num_running, num_waiting=s.num_waiting, num_used_blocks=s.num_blocks - s.num_free_blocks,
            num_free_blocks=s.num_free_blocks, num_blocks=s.num_blocks, prefix_cache_queries=s.prefix_queries,
            prefix_cache_hits=s.prefix_hits, num_preemptions=s.num_preemptions, steps=sent.steps,
            plan_bytes_sent=sent.plan_bytes, pipeline_depth=settings.pipeline_depth,
            stateless_worker=settings.stateless_worker, model_name=session.info.model_name,
            max_model_len=session.scheduler.max_model_len, vocab_size=session.info.vocab_size,
            decode_steps=sent.decode_steps, decode_plan_bytes=sent.decode_plan_bytes, incarnation=self.incarnation,
            lora_adapters=sorted(session.lora_adapters), num_draft_tokens=spec.num_draft_tokens,
            num_accepted_tokens=spec.num_accepted_tokens)

    async def LoadLoraAdapter(self, request, context):
        return await self._change_adapters(context, request.lora_name, request.lora_path)

    async def UnloadLoraAdapter(self, request, context):
        return await self._change_adapters(context, request.lora_name, None)

    async def _change_adapters(self, context, name: str, path: str | None) -> common_pb2.LoraAdapterResponse:
        if self.session.scheduler is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "not connected to a worker yet")
        try:
            adapters = await (load_adapter(self.session, name, path) if path is not None
                              else unload_adapter(self.session, name))
        except LoraChangeRefused as exc:
            await context.abort(exc.code, str(exc))
        return common_pb2.LoraAdapterResponse(lora_adapters=adapters)

    async def ResetPrefixCache(self, request, context):
        if self.session.scheduler is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "not connected to a worker yet")
        return scheduler_pb2.ResetPrefixCacheResponse(num_dropped_blocks=self.session.scheduler.reset_prefix_cache())

    async def WatchCache(self, request, context):
        if self.cache_feed is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "not connected to a worker yet")
        watcher = self.cache_feed.watch()
        try:
            while True:
                yield cache_update_to_proto(await watcher.next())
        except WatcherDropped as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        finally:
            self.cache_feed.unwatch(watcher)

    def spec_stats(self) -> SpecDecodeStats | None:
        return self.session.scheduler.spec_stats if self.session.scheduler is not None else None

    def scraped_metrics(self) -> dict[str, tuple[str, str, float]]:
        session = self.session
        if session.scheduler is None:
            return {}
        s, sent, spec = session.scheduler.stats(), session.workers.traffic, session.scheduler.spec_stats
        return {
            "vmesh:spec_decode_num_drafts": ("counter", "Speculative steps of a request with drafts.", spec.num_drafts),
            "vmesh:spec_decode_num_draft_tokens": ("counter", "Draft tokens proposed and verified.",
                                                   spec.num_draft_tokens),
            "vmesh:spec_decode_num_accepted_tokens": ("counter", "Draft tokens accepted.", spec.num_accepted_tokens),
            "vmesh:num_requests_running": ("gauge", "Requests in the running set.", s.num_running),
            "vmesh:num_requests_waiting": ("gauge", "Requests waiting to be admitted.", s.num_waiting),
            "vmesh:kv_cache_usage_perc": ("gauge", "Fraction of KV blocks in use (1 = full).", s.kv_usage),
            "vmesh:prefix_cache_queries": ("counter", "KV blocks looked up in the prefix cache.", s.prefix_queries),
            "vmesh:prefix_cache_hits": ("counter", "KV blocks found in the prefix cache.", s.prefix_hits),
            "vmesh:num_preemptions": ("counter", "Requests preempted (recomputed later).", s.num_preemptions),
            "vmesh:scheduler_steps": ("counter", "Step plans sent to the workers.", sent.steps),
            "vmesh:plan_bytes": ("counter", "Serialized plan bytes sent per worker rank.", sent.plan_bytes),
            "vmesh:worker_failovers": ("counter", "Times the worker was lost and its requests recomputed on its "
                                                  "replacement.", session.worker_failovers),
            "vmesh:detokenizer_replicas_routable": (
                "gauge", "Detokenizer replicas connected and taking new requests.",
                len(session.router.routable())),
        }


class AcceptedPerPosition(Collector):
    """vmesh:spec_decode_num_accepted_tokens_per_pos{position}: drafts accepted at each position."""

    def __init__(self, stats: Callable[[], SpecDecodeStats | None], model_name: str):
        self.stats = stats
        self.model_name = model_name

    def collect(self) -> Iterator[CounterMetricFamily]:
        stats = self.stats()
        metric = CounterMetricFamily("vmesh:spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted, by position in the draft.",
                                     labels=["model_name", "position"])
        for position, count in enumerate(stats.accepted_per_position if stats is not None else []):
            metric.add_metric([self.model_name, str(position)], count)
        yield metric


def _introduction(request: scheduler_pb2.SubmitRequestRequest, sampling: SamplingParams,
                  span: trace.Span) -> StreamStart:
    """What the request's detokenizer replica is told of it before its first tokens."""
    return StreamStart(
        RequestRef(request.frontend_id, request.frontend_key), list(request.prompt_token_ids[-PROMPT_TAIL_TOKENS:]),
        sampling, len(request.prompt_token_ids),
        trace_context=telemetry.trace_context(span) if telemetry.tracing_enabled() else TraceContext(),
        resumed_output_token_ids=list(request.resumed_output_token_ids),
        resumed_text_length=request.resumed_text_length)


async def serve(settings: SchedulerServiceSettings, server: ServerSettings) -> None:
    shell = ServiceShell("scheduler", scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"], server)
    identity = server.identity  # the scheduler's own certificate, presented to its workers and detokenizers
    session = SchedulerSession(settings, open_detokenizer_stream=lambda address: open_stream(address, identity),
                               open_worker_rank=lambda address: open_worker(address, identity))
    servicer = SchedulerServicer(session)
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(servicer, shell.server)
    servicer.metrics_registry = shell.metrics_registry()

    def on_serving(serving: bool) -> None:
        asyncio.get_running_loop().create_task(shell.set_serving(serving))

    def on_fatal(reason: str) -> None:
        logging.shutdown()
        os._exit(3)

    session.on_serving = on_serving
    session.on_fatal = on_fatal
    await shell.run(servicer.connect, session.drain)
    await session.close()
