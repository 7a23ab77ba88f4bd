"""A scheduler process's state and its engine loop: the scheduler core built from the worker's
geometry, the step pipeline to the worker ranks, the routes to the detokenizer replicas and each
request's lifetime. The loop sends up to `pipeline_depth` plans to every rank and routes each
step's tokens to the detokenizers; a worker lost meanwhile is waited for and every request
recomputed on it once it is back (services/scheduler/server.py is the gRPC face of all this).

A request is known here by its request key (the core's request_id); on the Execute stream by
its worker handle (the core's), and on its replica's stream by its stream handle (the router's)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from vmesh.services.common import telemetry
from vmesh.services.common.metrics import SchedulerMetrics
from vmesh.services.common.resume import EndedRequests, check_resume
from vmesh.services.common.runtime.discovery import AddressBook
from vmesh.services.common.runtime.retry import Backoff
from vmesh.services.common.runtime.tasks import TaskGroup, wait_until
from vmesh.services.common.step_timeline import SchedulerStepTiming, SchedulerTimeline, WorkerStepTiming
from vmesh.services.common.step_types import StepPlan
from vmesh.services.common.types import FinishReason, ModelLimits
from vmesh.services.common.wire.common import trace_context_to_proto
from vmesh.services.common.wire.step import result_from_proto
from vmesh.services.scheduler.detokenizer_router import DetokenizerRouter, OpenStream, Route, open_stream
from vmesh.services.scheduler.lifetimes import Lifetimes
from vmesh.services.scheduler.lora_admin import restore_adapters
from vmesh.services.scheduler.pipeline import StepPipeline
from vmesh.services.scheduler.request import Request
from vmesh.services.scheduler.scheduler import RequestUpdate, Scheduler
from vmesh.services.scheduler.settings import SchedulerServiceSettings
from vmesh.services.scheduler.worker_ranks import (
    WORKER_RETRY,
    OpenWorker,
    WorkerRanks,
    describe,
    detail,
    geometry,
    open_worker,
    plan_message,
    same_worker,
    taken_over,
    went_away,
)
from vmesh.v1 import worker_pb2

logger = logging.getLogger(__name__)

WORKER_START_TIMEOUT_S = 600.0  # for the worker ranks to answer at start-up (they may be loading the model)
# A request the worker was computing each of these many times it was lost is failed instead of
# computed again: it may be what kills the worker.
MAX_WORKER_LOSSES = 3


class SchedulerSession:
    def __init__(self, settings: SchedulerServiceSettings, open_detokenizer_stream: OpenStream = open_stream,
                 open_worker_rank: OpenWorker = open_worker, worker_retry: Backoff = WORKER_RETRY):
        self.settings = settings
        self.workers = WorkerRanks(settings.worker_addresses, open_worker_rank, worker_retry)
        self.info: worker_pb2.GetWorkerInfoResponse | None = None  # rank 0's, once the workers answered
        self.limits: ModelLimits | None = None  # the workers' model, known once they answered
        # The LoRA adapters every rank holds, by name: their directories (lora_admin.py).
        self.lora_adapters: dict[str, str] = {}
        self.scheduler: Scheduler | None = None  # the core, which exists once the workers answered
        self.pipeline: StepPipeline | None = None
        self.timeline = SchedulerTimeline()
        self.detokenizers = AddressBook(settings.detokenizer_addresses)
        self.router = DetokenizerRouter(self._released_by_router, open_detokenizer_stream)
        self.lifetimes = Lifetimes()
        # Resumable requests: those it holds by resume key (their request keys), and what ended ones made.
        self.resumable: dict[str, str] = {}
        self.ended = EndedRequests()
        self.metrics: SchedulerMetrics | None = None
        # Marked NOT_SERVING (False) while the worker is lost, SERVING once back.
        self.on_serving: Callable[[bool], None] = lambda serving: None
        # The worker came back unlike before (another model, KV cache or limits): serve() exits the
        # process, so that its supervisor starts a scheduler that adopts the new worker.
        self.on_fatal: Callable[[str], None] = lambda reason: None
        self.accepting = True  # False once draining
        self.recovering = False  # the worker is lost and waited for: submissions go elsewhere
        # Set while the worker is lost past its recovery timeout: submissions are refused.
        self.failure: str | None = None
        self.worker_failovers = 0  # times a lost worker's requests were recomputed on its replacement
        self.wake = asyncio.Event()  # set when there may be a plan to make
        self.engine_loop: asyncio.Task | None = None
        self._tasks = TaskGroup()

    # --- start-up and shut-down --------------------------------------------------------------

    async def connect_workers(self, timeout: float = WORKER_START_TIMEOUT_S) -> worker_pb2.GetWorkerInfoResponse:
        """Open the worker ranks' streams and build the scheduler core from their geometry."""
        info = self.info = await self.workers.open(timeout)
        self.limits = ModelLimits(info.model_name, info.max_model_len, info.vocab_size)
        self.lora_adapters = dict(zip(info.lora_adapters, info.lora_adapter_paths, strict=True))
        self.use_core(Scheduler.for_worker(self.settings, geometry(info)))
        return info

    def use_core(self, scheduler: Scheduler) -> None:
        """Plan with `scheduler` (built from the workers' geometry)."""
        self.scheduler = scheduler
        scheduler.on_finished = self._request_ended
        self.pipeline = StepPipeline(scheduler, self.settings.pipeline_depth)

    def set_metrics(self, metrics: SchedulerMetrics) -> None:
        self.metrics = self.lifetimes.metrics = metrics

    async def start(self) -> None:
        """Connect the detokenizer replicas (and follow their address book); start the engine loop."""
        await self.router.connect(self.detokenizers.addresses)
        self._tasks.spawn(self.router.replicas.follow(self.detokenizers, self.settings.replica_refresh_interval_s))
        self.engine_loop = self._tasks.spawn(self._run_engine())
        logger.info("connected to %d worker rank(s) (%d KV blocks of %d) and %d detokenizer(s)",
                    len(self.workers.calls), self.core().pool.num_blocks, self.core().pool.block_size,
                    len(self.router.replicas))

    def spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task:
        """Run `work` for as long as the session (closing it cancels the work)."""
        return self._tasks.spawn(work)

    async def drain(self) -> None:
        self.accepting = False
        await wait_until(lambda: self.scheduler is None or not self.scheduler.has_unfinished()
                         or bool(self.failure))

    async def close(self) -> None:
        self._tasks.cancel()
        self.router.close()
        await self.workers.close()

    # --- requests ----------------------------------------------------------------------------

    def core(self) -> Scheduler:
        if self.scheduler is None:
            raise RuntimeError("the scheduler core is used before the workers answered")
        return self.scheduler

    def model_limits(self) -> ModelLimits:
        if self.limits is None:
            raise RuntimeError("the model's limits are used before the workers answered")
        return self.limits

    def unavailable(self) -> str | None:
        """Why a submission is refused now (the frontend tries another group); None: it is taken."""
        if self.failure:
            return self.failure
        if not self.accepting or self.scheduler is None or self.recovering:
            return "the scheduler is not accepting requests"
        return None

    async def abort(self, key: str) -> bool:
        """Stop the request (a client went away); whether the core still had it."""
        aborted = self.scheduler is not None and self.scheduler.abort(key)
        if (route := self.release(key)) is not None:
            self.router.add_end(route)
            await self.router.flush()
        return aborted

    def add_resumable(self, request: Request) -> None:
        """A request its client may resume elsewhere (the core holds it already)."""
        if request.resume_key:
            self.resumable[request.resume_key] = request.request_id

    def _request_ended(self, request: Request) -> None:
        """Whatever ended a resumable request, what it made is kept for its client's resume."""
        if not request.resume_key:
            return
        if self.resumable.get(request.resume_key) == request.request_id:  # not a later submission's
            del self.resumable[request.resume_key]
        self.ended.keep(request.resume_key, request.prompt_digest, request.output_token_ids)

    async def take_over(self, resume_key: str, prompt_digest: bytes, num_output_tokens: int) -> list[int]:
        """A client resumes its stream through another frontend: the request stops here (if it still
        runs) and the first `num_output_tokens` of its outputs are handed over. Raises
        NothingToResume or ResumeRefused (services/common/resume.py)."""
        if (key := self.resumable.get(resume_key)) is not None and self.scheduler is not None:
            request = self.scheduler.requests[key]
            check_resume(request.prompt_digest, prompt_digest, len(request.output_token_ids), num_output_tokens)
            await self.abort(key)  # which keeps what it made (_request_ended)
        return self.ended.take(resume_key, prompt_digest, num_output_tokens)

    def release(self, key: str, finish_reason: str = FinishReason.ABORT.value) -> Route | None:
        """Close the request's route and end its lifetime; None if it has none (already released)."""
        route = self.router.close_route(key)
        self.lifetimes.end(key, finish_reason)
        return route

    def _fail(self, key: str, error: str) -> None:
        """End the request with `error` (UNAVAILABLE to the client), as the core drops it."""
        self.core().abort(key)
        if (route := self.release(key)) is not None:
            self.router.add_end(route, error=error)

    def _released_by_router(self, key: str, reason: FinishReason) -> None:
        """A stop string, an orphan or a lost replica: the router has closed the route already."""
        self.core().abort(key, reason)
        self.lifetimes.end(key, reason.value)

    async def _fail_all(self, message: str) -> None:
        """End every request this scheduler holds with `message` and refuse new ones."""
        self.failure = message
        for key in list(self.router.routes):
            self._fail(key, message)
        await self.router.flush()
        self.on_serving(False)

    # --- the engine loop ---------------------------------------------------------------------

    async def _run_engine(self) -> None:
        """Steps until cancelled. A worker that went away is waited for; one that failed otherwise,
        or came back unlike before, ends the loop."""
        while True:
            try:
                await self._run_steps()
            except Exception as exc:
                if not went_away(exc):
                    # The worker refused a plan (FAILED_PRECONDITION), or a bug here: recomputing
                    # would only repeat it.
                    # The traceback: a bug here is otherwise only a class name in a log line.
                    logger.error("the engine loop failed: %s: %s", type(exc).__name__, detail(exc), exc_info=exc)
                    await self._fail_all("the worker serving this request failed")
                    return
                logger.error("worker unavailable: %s; %d request(s) wait for it to come back", detail(exc),
                             len(self.router.routes))
                if not await self._recover_worker(taken_over(exc)):
                    return

    async def _run_steps(self) -> None:
        pipeline = self._pipeline()
        while True:
            planning = time.perf_counter()
            for plan in pipeline.plans():
                await self._send(plan, time.perf_counter() - planning)
                planning = time.perf_counter()
            if pipeline.idle:
                self.wake.clear()
                await self.wake.wait()
                continue
            read_started = time.perf_counter()
            message = await self.workers.receive()
            read_at = time.perf_counter()
            result = result_from_proto(message)
            step = self.timeline.read(result.step, read_started, read_at, time.perf_counter(), result.timing)
            self._route(pipeline.complete(result))
            await self.router.flush()
            if step is not None:
                step.result_handling_seconds = time.perf_counter() - read_at
                self._observe(step, result.timing)

    def _pipeline(self) -> StepPipeline:
        if self.pipeline is None:
            raise RuntimeError("the engine loop started before the workers answered")
        return self.pipeline

    async def _send(self, plan: StepPlan, planning_seconds: float) -> None:
        encoding = time.perf_counter()
        message = plan_message(plan, self.core(), full_state=self.settings.stateless_worker)
        for new in message.new_requests:  # requests entering the worker carry their trace context
            life = self.lifetimes.admitted(self.core().by_handle[new.handle].request_id)  # by worker handle
            if life is not None and telemetry.tracing_enabled():
                new.trace_context.CopyFrom(trace_context_to_proto(telemetry.trace_context(life.span)))
        if self.metrics and plan.scheduled_handles:
            self.metrics.iteration_tokens.observe(plan.total_scheduled_tokens)
        sending = time.perf_counter()
        await self.workers.send(plan, message)
        self.timeline.sent(plan.step, planning_seconds, sending - encoding, sending, time.perf_counter())

    def _observe(self, step: SchedulerStepTiming, worker: WorkerStepTiming | None) -> None:
        if self.metrics is None:
            return
        metrics = self.metrics.step
        metrics.planning.observe(step.planning_seconds)
        metrics.plan_encode.observe(step.encode_seconds + step.send_seconds)
        metrics.round_trip.observe(step.round_trip_seconds)
        if worker is not None:
            metrics.outside_worker.observe(step.outside_worker_seconds)
        metrics.result_wait.observe(step.result_wait_seconds)
        metrics.result_handling.observe(step.result_handling_seconds)

    def _route(self, updates: list[RequestUpdate]) -> None:
        """One step's tokens to the requests' detokenizer replicas."""
        for update in updates:
            if (route := self.router.routes.get(update.request_id)) is None:
                continue
            self.router.add_update(route, update)
            if update.finish_reason is not None:
                self.router.close_route(update.request_id)
        self.lifetimes.stepped(updates, time.monotonic())  # one clock read per step, not per request

    # --- a lost worker -----------------------------------------------------------------------

    async def _recover_worker(self, taken_over: bool = False) -> bool:
        """Wait for the lost worker to answer again (restarted in place, by `vmesh serve` or
        Kubernetes) and recompute every request on it: clients see a pause. Past the recovery
        timeout the requests fail with UNAVAILABLE and submissions are refused, but the worker is
        still waited for; once it is back the scheduler serves again. False: it never can (the
        replacement's model, KV cache or limits differ). `taken_over`: the worker is still there,
        another stream took it; a new session takes it back, after a wait."""
        await self._recompute_on_replacement()
        if taken_over:
            await self.workers.wait_to_take_back()
        lost_at = time.monotonic()
        info = await self._wait_for_worker(deadline=lost_at + self.settings.worker_recovery_timeout_s)
        if not same_worker(info, self.info):
            # E.g. a GPU's free memory sized the cache: a new scheduler process adopts it, and the
            # frontends fail this one's requests over.
            reason = (f"the worker came back unlike before ({describe(info)}, was "
                      f"{describe(self.info) if self.info else '-'}); restarting the scheduler")
            logger.error("%s", reason)
            self.on_fatal(reason)
            return False
        if time.monotonic() - lost_at < self.workers.retry.delay():  # lost and back at once: no hot loop
            await self.workers.retry.sleep()
        for name in await self._restore_adapters(lost_at):
            for request in [r for r in self.core().requests.values() if r.lora_name == name]:
                self._fail(request.request_id, f"LoRA adapter {name!r} could not be loaded again on this group")
            await self.router.flush()
        logger.warning("worker back after %.1f s; recomputing %d request(s)", time.monotonic() - lost_at,
                       len(self.core().requests))
        self.failure = None
        self.recovering = False
        self.on_serving(self.accepting)  # a scheduler draining meanwhile stays NOT_SERVING
        self.wake.set()
        return True

    async def _recompute_on_replacement(self) -> None:
        """Give up the lost worker's streams and plans in flight, and refuse submissions while it is
        away: every request starts again from its tokens on the worker that comes back, but one
        the worker was computing each of the last MAX_WORKER_LOSSES times it was lost, which fails."""
        self.workers.drop()
        self._pipeline().abandon_all()
        self.timeline.forget()
        core = self.core()
        was_computing = {r.request_id for r in core.running}
        affected = core.recompute_all()
        self.worker_failovers += 1
        self.recovering = True
        self.on_serving(False)
        for request in affected:
            if (life := self.lifetimes.get(request.request_id)) is None:
                continue
            life.span.add_event("vmesh.failover", {"vmesh.failover.kind": "worker"})
            if request.request_id in was_computing:
                life.worker_losses += 1
                if life.worker_losses >= MAX_WORKER_LOSSES:
                    logger.error("request %s was on the worker each of the %d times it was lost; failing it",
                                 request.request_id, life.worker_losses)
                    self._fail(request.request_id, "the worker failed each time it computed this request")
        await self.router.flush()

    async def _restore_adapters(self, lost_at: float) -> list[str]:
        """The group's adapters back on every rank before a plan names one (lora_admin.py): a rank
        lost again meanwhile is waited for again. Returns the adapters that could not be restored."""
        while True:
            try:
                return await restore_adapters(self, self.workers.infos)
            except ConnectionError as exc:
                logger.warning("worker lost again while its LoRA adapters were restored: %s", exc)
                self.workers.drop()
                await self._wait_for_worker(deadline=lost_at + self.settings.worker_recovery_timeout_s)

    async def _wait_for_worker(self, deadline: float) -> worker_pb2.GetWorkerInfoResponse:
        """The worker's answer once it is back, with its streams open again. Past `deadline` the
        requests fail meanwhile (once)."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 and self.failure is None:
                logger.error("the worker did not come back within %.0f s; failing %d request(s)",
                             self.settings.worker_recovery_timeout_s, len(self.router.routes))
                await self._fail_all("the worker serving this request became unavailable")
            try:
                return await self.workers.open(timeout=remaining if remaining > 0 else self.workers.retry.delay())
            except Exception as exc:
                logger.info("worker not reachable yet (%s)", detail(exc))
                await self.workers.retry.sleep()  # an attempt that failed at once is not repeated at once
