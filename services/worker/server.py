"""The worker's gRPC shell: plans in, results out, over one ordered stream per scheduler."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
from opentelemetry import trace

from vmesh.services.common import telemetry
from vmesh.services.common.grpc_server import ServiceShell
from vmesh.services.common.metrics import ScrapedMetrics, WorkerMetrics
from vmesh.services.common.server_settings import ServerSettings
from vmesh.services.common.step_timeline import WorkerStepTiming, WorkerTimeline
from vmesh.services.common.step_types import NewRequest, StepPlan, StepResult
from vmesh.services.common.types import SamplingParams
from vmesh.services.common.wire.step import plan_from_proto, result_to_proto, summary_to_proto
from vmesh.services.worker.lora_weights import LoraLoadError
from vmesh.services.worker.model_runner import ModelRunner
from vmesh.services.worker.persistent_batch import PlanError
from vmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)
TRACER = telemetry.tracer("vmesh.worker")


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, runner: ModelRunner, model_name: str):
        self.runner = runner
        self.model_name = model_name
        # One thread runs the model: steps execute strictly in order, the event loop stays free.
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vmesh-model")
        self.steps = 0
        self.busy_seconds = 0.0
        self.first_plan_at: float | None = None
        self.bytes_received = 0
        # Stateless mode: every token this worker sampled, per handle, since the scheduler may
        # plan before it has seen them.
        self.sampled_history: dict[int, list[int]] = {}
        self.span_contexts: dict[int, trace.SpanContext] = {}  # per handle, when tracing
        self.metrics: WorkerMetrics | None = None
        self.session = 0  # Execute streams opened so far; the newest one drives the worker
        # The newest stream's queue of step results: a newer stream ends it through this at once.
        self._session_steps: asyncio.Queue[asyncio.Future | None] | None = None
        self.timeline = WorkerTimeline()

    async def _loaded(self, context) -> ModelRunner:
        """The model runner; UNAVAILABLE while the model loads (the port is open before it is)."""
        if self.runner is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is still loading its model")
        return self.runner

    async def GetWorkerInfo(self, request, context):
        runner = await self._loaded(context)
        spec = runner.spec
        return worker_pb2.GetWorkerInfoResponse(
            model_name=self.model_name, num_kv_blocks=self.runner.kv_cache.num_blocks,
            block_size=self.runner.kv_cache.block_size, max_model_len=self.runner.max_model_len,
            vocab_size=spec.vocab_size, eos_token_ids=list(spec.eos_token_ids),
            max_num_seqs=self.runner.batch.max_num_reqs,
            tensor_parallel_size=runner.model.parallel.size if runner.model.parallel is not None else 1,
            num_speculative_tokens=runner.speculative.num_speculative_tokens if runner.speculative else 0,
            speculative_disable_by_batch_size=runner.speculative.disable_by_batch_size if runner.speculative else 0,
            lora_adapters=runner.lora.names() if runner.lora else [],
            lora_adapter_paths=runner.lora.paths() if runner.lora else [],
            max_loras=runner.lora.max_loras if runner.lora else 0,
            kv_cache_group_windows=[window or 0 for window in runner.kv_cache.layout.windows])

    async def LoadLoraAdapter(self, request, context):
        return await self._change_adapters(context, request.lora_name, request.lora_path)

    async def UnloadLoraAdapter(self, request, context):
        return await self._change_adapters(context, request.lora_name, None)

    async def _change_adapters(self, context, name: str, path: str | None) -> common_pb2.LoraAdapterResponse:
        """Load (`path`) or unload adapter `name` on the model thread, between two steps."""
        runner = await self._loaded(context)
        lora = runner.lora
        if lora is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this worker serves no LoRA adapters "
                                                                     "(start it with --enable-lora)")
        assert lora is not None, "abort raised"
        try:
            change = (lambda: lora.load(name, path)) if path is not None else (lambda: lora.unload(name, runner.batch))
            await asyncio.get_running_loop().run_in_executor(self.executor, change)
        except LoraLoadError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        logger.info("LoRA adapter %s %s", name, f"loaded from {path}" if path is not None else "unloaded")
        return common_pb2.LoraAdapterResponse(lora_adapters=lora.names())

    def wall_seconds(self) -> float:
        """Since the first plan (0 before it)."""
        return time.perf_counter() - self.first_plan_at if self.first_plan_at else 0.0

    def duty_cycle(self) -> float:
        """Forward + sampling time over wall time since the first plan."""
        wall = self.wall_seconds()
        return self.busy_seconds / wall if wall else 0.0

    def scraped_metrics(self) -> dict[str, tuple[str, str, float]]:
        return {
            "vmesh:worker_duty_cycle": ("gauge", "Forward + sampling time over wall time since the first plan.",
                                        self.duty_cycle()),
            "vmesh:worker_busy_seconds": ("counter", "Forward + sampling time.", self.busy_seconds),
            "vmesh:worker_steps": ("counter", "Steps executed.", self.steps),
            "vmesh:worker_batch_rows": ("gauge", "Requests held in the persistent batch.",
                                        len(self.runner.batch) if self.runner else 0),
        }

    async def GetWorkerStats(self, request, context):
        runner = await self._loaded(context)
        return worker_pb2.GetWorkerStatsResponse(
            steps=self.steps, busy_seconds=self.busy_seconds, wall_seconds=self.wall_seconds(),
            duty_cycle=self.duty_cycle(), bytes_received=self.bytes_received,
            num_rows=len(runner.batch), timeline=summary_to_proto(self.timeline.summary(request.timeline_from_step)))

    async def Execute(self, request_iterator, context):
        """One stream is one scheduler's session. A new stream (a restarted scheduler) takes
        over: the worker forgets the old session's requests and step numbering, and the old
        stream ends at once with ABORTED, so that a scheduler whose stream a stranger (or a
        stale scheduler) took reconnects and takes it back rather than waiting on it."""
        await self._loaded(context)
        loop = asyncio.get_running_loop()
        self.session += 1
        session = self.session
        steps: asyncio.Queue[asyncio.Future | None] = asyncio.Queue()
        if self._session_steps is not None:
            self._session_steps.put_nowait(_failed(loop, TakenOver()))  # after the steps it already began
        self._session_steps = steps
        if session > 1:
            model = getattr(self.runner, "model", None)
            if (parallel := getattr(model, "parallel", None)) is not None:
                # Another rank may still be inside a collective of the old session's last step, which
                # this rank never received: its next collectives would pair with that one's (wrong
                # sums, or a hang). A group starts a new session only by starting again, together.
                parallel.fail("a new scheduler session began; the group restarts to begin it in step")
            logger.warning("a new scheduler stream took over; forgetting the previous session's requests")
        await loop.run_in_executor(self.executor, self._reset)  # after any step still running
        self.timeline.new_session()
        # Each plan goes to the model thread as soon as it is read, not once the previous result
        # is written: the thread starts step N+1 the moment step N ends, while this loop encodes
        # and writes result N.
        reader = asyncio.ensure_future(self._submit_plans(request_iterator, session, steps))
        try:
            while (step := await steps.get()) is not None:
                try:
                    result = await step
                except PlanError as exc:
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"rejected plan: {exc}")
                except TakenOver:
                    await context.abort(grpc.StatusCode.ABORTED, "a newer scheduler stream took over this worker")
                encoding = time.perf_counter()
                yield result_to_proto(result)
                sent = time.perf_counter()  # the transport took the message
                self.timeline.sent(result.timing, sent, sent - encoding)
                if self.metrics:
                    self.metrics.result_encode.observe(sent - encoding)
        finally:
            reader.cancel()
            if self._session_steps is steps:
                self._session_steps = None
            while not steps.empty():  # steps no one will read now: their failures are not news
                if (left := steps.get_nowait()) is not None:
                    left.add_done_callback(_retrieved)

    async def _submit_plans(self, request_iterator, session: int, steps: asyncio.Queue) -> None:
        """Hand each plan of the stream to the model thread as it arrives; `steps` gets the
        futures of their results, in order, then None. A failure to read ends `steps` with it."""
        loop = asyncio.get_running_loop()
        try:
            async for request in request_iterator:
                received = time.perf_counter()
                if session != self.session:
                    steps.put_nowait(_failed(loop, TakenOver()))
                    return
                if self.first_plan_at is None:
                    self.first_plan_at = received
                self.bytes_received += request.ByteSize()
                steps.put_nowait(loop.run_in_executor(self.executor, self._execute, request, received))
        except Exception as exc:
            steps.put_nowait(_failed(loop, exc))
            return
        steps.put_nowait(None)

    def _reset(self) -> None:
        self.runner.reset()
        self.sampled_history.clear()
        self.span_contexts.clear()

    def _execute(self, request: worker_pb2.ExecuteRequest, received: float):
        started = time.perf_counter()
        plan = plan_from_proto(request)
        if request.full_state:
            self._rebuild_batch(plan)
        decoded = time.perf_counter()
        if telemetry.tracing_enabled():
            with self._step_span(request, plan) as span:
                result = self.runner.execute(plan)
                result.timing = self._timed(plan, result, received, started, decoded)
                telemetry.annotate_step(span, result.timing, started + result.timing.plan_decode_seconds
                                        + result.timing.execute_seconds, time.perf_counter())
        else:
            result = self.runner.execute(plan)
            result.timing = self._timed(plan, result, received, started, decoded)
        self.steps += 1
        busy = result.forward_seconds + result.sampling_seconds
        self.busy_seconds += busy
        if self.metrics and plan.scheduled_handles:
            self.metrics.step_time.observe(busy)
            self.metrics.batch_size.observe(len(plan.scheduled_handles))
            self.metrics.scheduled_tokens.inc(plan.total_scheduled_tokens)
        if request.full_state:
            for handle, token in zip(result.handles, result.sampled_token_ids):
                self.sampled_history.setdefault(handle, []).append(token)
        return result

    def _timed(self, plan: StepPlan, result: StepResult, received: float, started: float,
               decoded: float) -> WorkerStepTiming:
        """The step's place on the timeline, also observed in the metrics."""
        timing = self.timeline.executed(plan.step, len(plan.scheduled_handles), plan.total_scheduled_tokens,
                                        received, started, decoded, time.perf_counter(), result.forward_seconds,
                                        result.sampling_seconds)
        if self.metrics:
            if timing.idle_before_seconds is not None and timing.waited_for_plan_seconds is not None:
                self.metrics.idle_gap.observe(timing.idle_before_seconds)
                self.metrics.waited_for_plan.observe(timing.waited_for_plan_seconds)
            self.metrics.plan_wait.observe(timing.plan_wait_seconds)
            self.metrics.plan_decode.observe(timing.plan_decode_seconds)
        return timing

    def _step_span(self, request: worker_pb2.ExecuteRequest, plan: StepPlan):
        """One span per step, linked to every request it served (and parented by the first,
        so that a request's trace shows the steps that computed it)."""
        for handle in plan.removed_handles:
            self.span_contexts.pop(handle, None)
        for new in request.new_requests:
            span_context = telemetry.span_context_of(new.trace_context)
            if span_context is not None:
                self.span_contexts[new.handle] = span_context
        served = [c for h in plan.scheduled_handles if (c := self.span_contexts.get(h)) is not None]
        parent = trace.set_span_in_context(trace.NonRecordingSpan(served[0])) if served else None
        return TRACER.start_as_current_span(
            "worker.step", context=parent, links=[trace.Link(c) for c in served],
            attributes={"vmesh.step": plan.step, "vmesh.batch_size": len(plan.scheduled_handles),
                        "vmesh.scheduled_tokens": plan.total_scheduled_tokens})

    def _rebuild_batch(self, plan: StepPlan) -> None:
        """Stateless (V0) mode: forget every row and rebuild the batch from the plan alone. A
        grammar matcher is the one thing kept (the plan cannot carry its state): a re-added
        request's matcher is its own, advanced by the outputs it has not accepted yet, rather
        than a new one replaying them all every step."""
        for handle in list(self.runner.batch.handle_of_row):
            self.runner.batch.remove(handle, keep_grammar=True)
        # A request left out of this plan has no token in flight that the scheduler has not
        # seen by the time it is scheduled again (two steps on at the earliest), so its history
        # can go.
        live = {r.handle for r in plan.new_requests}
        self.sampled_history = {h: t for h, t in self.sampled_history.items() if h in live}
        completed: list[NewRequest] = []
        for r in plan.new_requests:
            known_outputs = len(r.token_ids) - r.num_prompt_tokens
            r.token_ids += self.sampled_history.get(r.handle, [])[known_outputs:]
            completed.append(r)
        plan.new_requests = completed


class TakenOver(Exception):
    """A newer scheduler stream took over the worker."""


def _retrieved(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


def _failed(loop: asyncio.AbstractEventLoop, exc: BaseException) -> asyncio.Future:
    future = loop.create_future()
    future.set_exception(exc)
    return future


async def serve(load_runner: Callable[[], ModelRunner], model_name: str, server: ServerSettings) -> None:
    shell = ServiceShell("worker", worker_pb2.DESCRIPTOR.services_by_name["WorkerService"], server)
    servicer = WorkerServicer(None, model_name)  # type: ignore[arg-type]  # the runner is set once loaded
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, shell.server)
    if registry := shell.metrics_registry():
        servicer.metrics = WorkerMetrics(registry, model_name)
        registry.register(ScrapedMetrics(servicer.scraped_metrics, model_name))

    async def warm_up() -> None:
        # Health stays NOT_SERVING while the model loads and runs one throwaway step.
        loop = asyncio.get_running_loop()
        servicer.runner = await loop.run_in_executor(servicer.executor, load_runner)
        await loop.run_in_executor(servicer.executor, _warm_step, servicer.runner)

    async def drain() -> None:
        # The scheduler drains; a worker's in-flight step ends with its stream. A tensor-parallel
        # group stops together: a peer that exits first is not a broken group.
        if servicer.runner is not None and servicer.runner.model.parallel is not None:
            servicer.runner.model.parallel.leave()

    await shell.run(warm_up, drain)
    servicer.executor.shutdown(wait=False, cancel_futures=True)


def _warm_step(runner: ModelRunner) -> None:
    """Run one tiny request through the model so the first real step pays no first-call costs,
    then leave the runner as if nothing happened (step numbering restarts at 0)."""
    handle = -1
    one_block_per_group = list(range(runner.kv_cache.num_groups))  # a windowed model's KV has several groups
    runner.execute(StepPlan(0, new_requests=[NewRequest(handle, [0, 1], 2, SamplingParams(temperature=0),
                                                        one_block_per_group)],
                            scheduled_handles=[handle], num_scheduled_tokens=[2]))
    runner.execute(StepPlan(1, removed_handles=[handle]))
    runner.reset()
