"""Where one request runs, and where it runs next when it loses its scheduler group or its
detokenizer replica: it is submitted again, under a new frontend key, with the tokens (and the
length of text) the client has already received, so the client sees one uninterrupted stream (a
failover). Also the submission itself (routing over the groups) and the aborts that stop a request
wherever it still runs."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

import grpc
from opentelemetry import trace

from vmesh.services.common.generation import Submission
from vmesh.services.common.metrics import FrontendMetrics
from vmesh.services.frontend.errors import Code, RequestError
from vmesh.services.frontend.outbox import LostService, Outbox, PendingOutput
from vmesh.services.frontend.prefix_routing import PromptRoute
from vmesh.services.frontend.schedulers import SchedulerGroup, SchedulerPool

logger = logging.getLogger(__name__)

SUBMIT_TIMEOUT_S = 30.0
MAX_FAILOVERS = 8  # per request: a request that keeps losing its services is given up
TARGET_POLL_S = 0.1
ABORT_TIMEOUT_S = 5.0
_PASSED_THROUGH = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                   grpc.StatusCode.DEADLINE_EXCEEDED}
# Codes a scheduler answers when it did not queue the request. Any other failure (a deadline that
# passed while the reply travelled, a cancelled call, a broken stream) leaves the outcome unknown,
# so the request is aborted there: an abort of a request the scheduler never took does nothing.
# UNAVAILABLE counts as a refusal because the same key is submitted again after it; should the
# scheduler have taken it anyway, its outputs reach a key this frontend no longer serves, and
# those are aborted as they arrive (FrontendCore.dispatch).
_REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ALREADY_EXISTS,
             grpc.StatusCode.UNAVAILABLE}
DETOKENIZER_LOST = "the detokenizer serving this request became unavailable"

TimeRemaining = Callable[[], float | None]


class Mesh(Protocol):
    """What a route needs of the frontend (FrontendCore): its id, its scheduler groups, the
    detokenizer replicas it listens to, and its outboxes by frontend key."""

    frontend_id: str
    schedulers: SchedulerPool
    metrics: FrontendMetrics | None
    aborted: RecentKeys

    @property
    def failover_timeout_s(self) -> float: ...

    @property
    def subscribed(self) -> set[str]: ...

    def listening(self) -> list[str]: ...

    def register(self, outbox: Outbox) -> int: ...

    def unregister(self, frontend_key: int, outbox: Outbox) -> None: ...

    def spawn(self, work: Coroutine[Any, Any, None]) -> None: ...


class RecentKeys:
    """The last `size` frontend keys aborted: outputs still on their way for one of them need no
    second abort. Bounded, so that a flood of strays costs a fixed amount of memory."""

    def __init__(self, size: int = 4096):
        self.size = size
        self._keys: OrderedDict[int, None] = OrderedDict()

    def add(self, frontend_key: int) -> bool:
        """Remember `frontend_key`; False when it was already remembered."""
        if frontend_key in self._keys:
            return False
        self._keys[frontend_key] = None
        if len(self._keys) > self.size:
            self._keys.popitem(last=False)
        return True

    def __contains__(self, frontend_key: object) -> bool:
        return frontend_key in self._keys


def abort_stray(mesh: Mesh, frontend_key: int) -> None:
    """An unfinished output reached a key this frontend does not serve (its request ended, or its
    submission's outcome was unknown): it runs somewhere for nobody, so every group is told to
    abort it (keys are unique: a group that does not hold it ignores the abort)."""
    if not mesh.aborted.add(frontend_key):
        return
    for group in mesh.schedulers.members.active():
        if group.alive:
            mesh.schedulers.acquire(group)  # the abort releases it
            mesh.spawn(abort(mesh, group, frontend_key))


class MeshPath:
    """One request's way through the mesh: the submission (under its current frontend key), the
    group that took it, and how often it failed over."""

    def __init__(self, mesh: Mesh, submission: Submission, outbox: Outbox,
                 time_remaining: TimeRemaining, span: trace.Span):
        self.mesh = mesh
        self.submission = submission
        self.outbox = outbox
        self.time_remaining = time_remaining
        self.span = span
        self.group: SchedulerGroup | None = None
        self.failovers = 0

    async def submit(self) -> None:
        self.group = await _submit_when_possible(self.mesh, self.submission, self.outbox, self.time_remaining)

    def may_fail_over(self, out: PendingOutput) -> bool:
        """Whether an error output leaves the request a way on: a lost service, while it has failovers left."""
        return out.lost is not None and self.failovers < MAX_FAILOVERS

    async def fail_over(self, out: PendingOutput, request_id: str) -> None:
        """Its scheduler or detokenizer replica was lost (`out.lost`): continue elsewhere."""
        assert out.lost is not None
        self.failovers += 1
        received = self.outbox.received_token_ids
        logger.warning("request %s: %s; failing over with %d output token(s)", request_id, out.error, len(received))
        self.span.add_event("vmesh.failover", {"vmesh.failover.kind": out.lost.value,
                                               "vmesh.resumed_output_tokens": len(received)})
        if self.mesh.metrics:
            self.mesh.metrics.failover(out.lost.value)
        # Aborted there even when its scheduler looks gone: it may be alive behind a broken link.
        self._let_go()
        self.submission.frontend_key = self.mesh.register(self.outbox)
        self.submission.resumed_output_token_ids[:] = received
        self.submission.resumed_text_length = self.outbox.received_text_length
        self.outbox.reopen()
        await self.submit()

    def close(self, finished: bool) -> None:
        """The request ended. Unfinished (the client went away, its deadline passed, or it
        failed): abort it everywhere."""
        if self.group is not None and finished:  # nothing left to abort
            self.mesh.schedulers.release(self.group)
            self.group = None
        self._let_go()

    def _let_go(self) -> None:
        """Stop serving the current frontend key: its group aborts it (wherever it still runs; a
        lost group's abort just fails) and a leaving replica may go once it serves nothing else."""
        self.mesh.unregister(self.submission.frontend_key, self.outbox)
        if self.group is not None:
            self.mesh.aborted.add(self.submission.frontend_key)  # before outputs on their way arrive
            self.mesh.spawn(abort(self.mesh, self.group, self.submission.frontend_key))
        self.group = None
        self.outbox.group = self.outbox.detokenizer = None


async def _submit_when_possible(mesh: Mesh, submission: Submission, outbox: Outbox,
                                time_remaining: TimeRemaining) -> SchedulerGroup:
    """Submit once a scheduler group and a detokenizer replica are there to take the request,
    waiting up to the failover timeout for them (a lost one restarting): a group that refuses
    with UNAVAILABLE is tried again until then. Returns the group that took it."""
    deadline = time.monotonic() + mesh.failover_timeout_s
    while True:
        remaining = time_remaining()
        if remaining is not None and remaining <= 0:
            raise RequestError(Code.DEADLINE_EXCEEDED, "the request's deadline passed before it was submitted")
        listening = mesh.listening()
        if listening and mesh.schedulers.candidates():
            submission.detokenizers[:] = listening
            try:
                group, detokenizer = await submit(mesh, submission, time_remaining)
            except RequestError as exc:
                if exc.code != Code.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                if submission.frontend_key in mesh.aborted:  # taken perhaps, and being aborted: try anew
                    mesh.unregister(submission.frontend_key, outbox)
                    submission.frontend_key = mesh.register(outbox)
            else:
                outbox.group = group
                outbox.detokenizer = detokenizer
                if detokenizer not in mesh.subscribed:  # lost while the scheduler chose it
                    outbox.put(PendingOutput(error=DETOKENIZER_LOST, lost=LostService.DETOKENIZER))
                return group
        elif time.monotonic() > deadline:
            what = "detokenizer replica is reachable" if not listening else "scheduler is available"
            raise RequestError(Code.UNAVAILABLE, f"no {what}")
        await asyncio.sleep(TARGET_POLL_S)


async def submit(mesh: Mesh, submission: Submission,
                 time_remaining: TimeRemaining = lambda: None,
                 ) -> tuple[SchedulerGroup, str]:
    """Submit to the group routing prefers (prefix_routing.py; or the least busy); a group that
    is down or failed did not take the request, so the next one is tried. Raises RequestError when
    no group takes it. Returns the group that took it and the detokenizer replica it chose."""
    error: grpc.aio.AioRpcError | None = None
    pool = mesh.schedulers
    # What the group will cache: the prompt and the outputs it resumes with.
    route = PromptRoute([*submission.prompt_token_ids, *submission.resumed_output_token_ids], submission.lora_name)
    for group in pool.candidates(route):
        remaining = time_remaining()
        if remaining is not None and remaining <= 0:
            raise RequestError(Code.DEADLINE_EXCEEDED, "the request's deadline passed before it was submitted")
        timeout = min(SUBMIT_TIMEOUT_S, remaining) if remaining is not None else SUBMIT_TIMEOUT_S
        pool.acquire(group)
        call = asyncio.ensure_future(group.submit(submission, timeout))
        try:
            detokenizer = await asyncio.shield(call)
            pool.routed(group, route)
            return group, detokenizer
        except asyncio.CancelledError:
            # The client left while the scheduler was taking the request: the scheduler may
            # still take it, so abort it there once the submission resolves.
            mesh.spawn(_abort_once_submitted(mesh, call, group, submission.frontend_key))
            raise
        except grpc.aio.AioRpcError as exc:
            _let_go_unless_refused(mesh, group, submission.frontend_key, exc)
            error = exc
            if exc.code() != grpc.StatusCode.UNAVAILABLE:
                break
    if error is None:
        raise RequestError(Code.UNAVAILABLE, "no scheduler is available")
    if error.code() in _PASSED_THROUGH:  # the scheduler's own words about the request
        raise RequestError(error.code(), error.details() or "")
    # gRPC's text names internal addresses: the log keeps it, the client gets the gist.
    logger.warning("submission failed: %s %s", error.code().name, error.details())
    raise RequestError(grpc.StatusCode.UNAVAILABLE, "no scheduler is available")


def _let_go_unless_refused(mesh: Mesh, group: SchedulerGroup, frontend_key: int, exc: grpc.aio.AioRpcError) -> None:
    """A submission failed: the group is released, after an abort unless it refused the request."""
    if exc.code() in _REFUSALS:
        mesh.schedulers.release(group)
    else:
        mesh.aborted.add(frontend_key)  # at once: a retry must not reuse the key
        mesh.spawn(abort(mesh, group, frontend_key))


async def _abort_once_submitted(mesh: Mesh, call: asyncio.Future, group: SchedulerGroup, frontend_key: int) -> None:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        _let_go_unless_refused(mesh, group, frontend_key, exc)
        return
    except asyncio.CancelledError:  # the frontend is closing: its schedulers' connections go with it
        mesh.schedulers.release(group)
        return
    await abort(mesh, group, frontend_key)


async def abort(mesh: Mesh, group: SchedulerGroup, frontend_key: int) -> None:
    """Stop the request in `group` (idempotent: a request it no longer holds is no error) and release the group."""
    mesh.aborted.add(frontend_key)
    try:
        await group.abort(mesh.frontend_id, frontend_key, ABORT_TIMEOUT_S)
    except grpc.aio.AioRpcError as exc:  # its scheduler is gone, say: then so is the request
        logger.info("abort of request %d failed: %s", frontend_key, exc.details())
    finally:
        mesh.schedulers.release(group)
