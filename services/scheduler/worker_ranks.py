"""The scheduler's link to its worker group: one Execute stream per rank, rank 0 first. Every
plan goes to every rank; rank 0's result is the step's (the ranks of a tensor-parallel group
compute one step together)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from vmesh.services.common.grpc_server import channel
from vmesh.services.common.runtime.retry import Backoff
from vmesh.services.common.step_types import NewRequest, StepPlan
from vmesh.services.common.tls import Identity
from vmesh.services.common.wire.step import plan_to_proto
from vmesh.services.scheduler.scheduler import Scheduler, WorkerGeometry
from vmesh.v1 import worker_pb2, worker_pb2_grpc

WORKER_RETRY = Backoff(1.0)  # between attempts to reach a worker that does not answer (yet)
# Before taking back a worker another stream took over: doubled while it keeps happening (two
# schedulers given one worker must not take it from each other in a hot loop).
TAKE_BACK = Backoff(1.0, factor=2.0, max_s=60.0)
TAKEOVERS_FORGOTTEN_AFTER_S = 120.0


class WorkerStub(Protocol):
    """The two WorkerService calls the scheduler makes (worker_pb2_grpc.WorkerServiceStub)."""

    def GetWorkerInfo(self, request: worker_pb2.GetWorkerInfoRequest,
                      **options: Any) -> Awaitable[worker_pb2.GetWorkerInfoResponse]: ...

    def Execute(self) -> grpc.aio.StreamStreamCall: ...


OpenWorker = Callable[[str], tuple[WorkerStub, grpc.aio.Channel]]


def open_worker(address: str, identity: Identity | None = None) -> tuple[WorkerStub, grpc.aio.Channel]:
    """`identity`: the scheduler's, with mutual TLS."""
    ch = channel(address, "worker", identity=identity)
    return worker_pb2_grpc.WorkerServiceStub(ch), ch


@dataclass
class PlanTraffic:
    """The step plans sent so far, and their serialized bytes (per worker rank)."""
    steps: int = 0
    plan_bytes: int = 0
    decode_steps: int = 0  # plans that only decode: no new request, one token each
    decode_plan_bytes: int = 0

    def count(self, plan: StepPlan, size: int) -> None:
        self.steps += 1
        self.plan_bytes += size
        if not plan.new_requests and all(n == 1 for n in plan.num_scheduled_tokens):
            self.decode_steps += 1
            self.decode_plan_bytes += size


class WorkerRanks:
    def __init__(self, addresses: list[str], open_rank: OpenWorker = open_worker,
                 retry: Backoff = WORKER_RETRY, take_back: Backoff = TAKE_BACK):
        self.addresses = addresses
        self.retry = retry
        self.take_back = take_back
        self.takeovers = 0  # in a row, each within TAKEOVERS_FORGOTTEN_AFTER_S of the one before
        self._last_takeover = 0.0
        self._open_rank = open_rank
        self.stubs: list[WorkerStub] = []  # dialled at the first `open`, on the event loop
        self._channels: list[grpc.aio.Channel] = []
        self.calls: list[grpc.aio.StreamStreamCall] = []
        self.infos: list[worker_pb2.GetWorkerInfoResponse] = []  # every rank's answer at the last `open`
        self.traffic = PlanTraffic()

    async def open(self, timeout: float) -> worker_pb2.GetWorkerInfoResponse:
        """Ask every rank for its model and KV cache, then open a new Execute stream to each (a
        new session: the worker forgets any earlier one). Returns rank 0's answer. A rank still
        loading its model answers UNAVAILABLE: it is asked again until `timeout`."""
        deadline = time.monotonic() + timeout
        if not self.stubs:
            for address in self.addresses:
                stub, ch = self._open_rank(address)
                self.stubs.append(stub)
                self._channels.append(ch)
        infos = self.infos = [await self._info(stub, deadline) for stub in self.stubs]
        info = infos[0]
        if any(i.num_kv_blocks != info.num_kv_blocks or i.block_size != info.block_size
               or i.kv_cache_group_windows != info.kv_cache_group_windows for i in infos):
            raise RuntimeError("worker ranks disagree on their KV cache")
        group_sizes = {max(1, i.tensor_parallel_size) for i in infos}
        if group_sizes != {1} and group_sizes != {len(infos)}:
            # A rank left out never gets plans, and the others wait for it in every collective.
            raise RuntimeError(f"--workers names {len(infos)} worker(s), but they report tensor-parallel "
                               f"group sizes {sorted(group_sizes)}: name every rank of the group, rank 0 first")
        self.calls = [stub.Execute() for stub in self.stubs]
        return info

    async def _info(self, stub: WorkerStub, deadline: float) -> worker_pb2.GetWorkerInfoResponse:
        while True:
            try:
                return await stub.GetWorkerInfo(worker_pb2.GetWorkerInfoRequest(), wait_for_ready=True,
                                                timeout=max(0.1, deadline - time.monotonic()))
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() + self.retry.delay() > deadline:
                    raise
                await self.retry.sleep()

    async def send(self, plan: StepPlan, message: worker_pb2.ExecuteRequest) -> None:
        """`plan`, as `message`, to every rank."""
        self.traffic.count(plan, message.ByteSize())
        for call in self.calls:
            try:
                await call.write(message)
            except asyncio.InvalidStateError:  # the stream had ended: reading it raises the status it ended with
                await call.read()
                raise ConnectionError("a worker closed its stream") from None
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.INTERNAL:
                    raise
                # A write that lost the race with the stream's end: grpc.aio reports INTERNAL in
                # place of the status the worker sent (grpc/grpc#36066), so the cause is unknown.
                raise StreamEndedUnseen(exc.details() or "") from exc

    async def receive(self) -> worker_pb2.ExecuteResponse:
        """The step's result: every rank's, of which rank 0's is the one that counts."""
        results = [await call.read() for call in self.calls]
        if any(r is grpc.aio.EOF for r in results):
            raise ConnectionError("a worker closed its stream")
        return results[0]

    async def wait_to_take_back(self) -> None:
        """Another stream took the worker over (a stranger, or a stale scheduler): the wait before
        opening a new session, which takes it back."""
        now = time.monotonic()
        self.takeovers = 1 if now - self._last_takeover > TAKEOVERS_FORGOTTEN_AFTER_S else self.takeovers + 1
        self._last_takeover = now
        await self.take_back.sleep(self.takeovers)

    def drop(self) -> None:
        """The group was lost: its streams are given up (a new session starts with `open`)."""
        for call in self.calls:
            call.cancel()
        self.calls = []

    async def close(self) -> None:
        for ch in self._channels:
            await ch.close()


def plan_message(plan: StepPlan, scheduler: Scheduler, full_state: bool) -> worker_pb2.ExecuteRequest:
    """The Execute message of `plan`. `full_state` (V0's behaviour, for measurement): every
    scheduled request travels in full, every step, and the worker rebuilds its batch from them."""
    if not full_state:
        return plan_to_proto(plan)
    full = StepPlan(step=plan.step, scheduled_handles=plan.scheduled_handles,
                    num_scheduled_tokens=plan.num_scheduled_tokens)
    for worker_handle, n in zip(plan.scheduled_handles, plan.num_scheduled_tokens):
        r = scheduler.by_handle[worker_handle]
        full.new_requests.append(NewRequest(worker_handle, r.all_token_ids, len(r.prompt_token_ids), r.sampling,
                                            r.tables.flat(), r.num_computed_tokens - n, r.lora_name))
    return plan_to_proto(full, full_state=True)


def geometry(info: worker_pb2.GetWorkerInfoResponse) -> WorkerGeometry:
    return WorkerGeometry(max_model_len=info.max_model_len, max_num_seqs=info.max_num_seqs,
                          num_kv_blocks=info.num_kv_blocks, block_size=info.block_size,
                          eos_token_ids=tuple(info.eos_token_ids), num_speculative_tokens=info.num_speculative_tokens,
                          speculative_disable_by_batch_size=info.speculative_disable_by_batch_size,
                          max_loras=info.max_loras,
                          kv_cache_windows=tuple(w or None for w in info.kv_cache_group_windows) or (None,))


def same_worker(info: worker_pb2.GetWorkerInfoResponse, before: worker_pb2.GetWorkerInfoResponse | None) -> bool:
    """Whether a worker that came back is the one the scheduler core was built for: the same model,
    KV cache and limits. Its LoRA adapters may differ (a restart forgets those loaded at run time;
    the scheduler loads them again)."""
    if before is None:
        return False
    now, was = worker_pb2.GetWorkerInfoResponse(), worker_pb2.GetWorkerInfoResponse()
    now.CopyFrom(info)
    was.CopyFrom(before)
    for message in (now, was):
        message.ClearField("lora_adapters")
        message.ClearField("lora_adapter_paths")
    return now == was


def describe(info: worker_pb2.GetWorkerInfoResponse) -> str:
    return (f"{info.model_name}, {info.num_kv_blocks} KV blocks of {info.block_size}, max_model_len "
            f"{info.max_model_len}, max_num_seqs {info.max_num_seqs}")


class StreamEndedUnseen(ConnectionError):
    """A plan's write found the Execute stream already ended, and grpc.aio lost the status it ended
    with: the worker may have gone, or a newer stream may have taken it over. Recovered from as a
    takeover (its wait grows if it repeats); a request that the worker refuses each time still
    fails after MAX_WORKER_LOSSES."""


def went_away(exc: Exception) -> bool:
    """Whether an Execute stream failed because its worker went (died, restarted, unreachable)
    or a newer stream took the worker over (ABORTED: a stranger, or a stale scheduler), which
    opening a new session recovers from (newest wins), as opposed to a refusal or a bug."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED)
    return isinstance(exc, ConnectionError)  # the worker closed its stream (it drained and exited)


def taken_over(exc: Exception) -> bool:
    """Whether an Execute stream ended because a newer one took the worker over (or may have)."""
    return isinstance(exc, StreamEndedUnseen) or (
        isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.ABORTED)


def detail(exc: Exception) -> str:
    return exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
