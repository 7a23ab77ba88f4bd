"""A scheduler group's LoRA adapters: which its workers hold, a load or unload on every worker
rank of the group at once (services/common/lora_rollout.py), refused while a request of the
group still uses the adapter, and the adapters given back to ranks that restarted without them."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import grpc

from vmesh.services.common.lora_rollout import RolloutFailed, load_everywhere, unload_everywhere

if TYPE_CHECKING:
    from vmesh.services.scheduler.session import SchedulerSession
    from vmesh.v1 import worker_pb2

logger = logging.getLogger(__name__)


class LoraChangeRefused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def _ranks(session: SchedulerSession) -> list[tuple[str, object]]:
    # Named by rank, not address: the message may reach a client.
    return [(f"worker rank {i}", stub) for i, stub in enumerate(session.workers.stubs)]


async def load_adapter(session: SchedulerSession, name: str, path: str) -> list[str]:
    if not name or not path:
        raise LoraChangeRefused(grpc.StatusCode.INVALID_ARGUMENT, "lora_name and lora_path are both required")
    if name in session.lora_adapters:
        raise LoraChangeRefused(grpc.StatusCode.ALREADY_EXISTS, f"a LoRA adapter named {name!r} is already loaded")
    try:
        adapters = await load_everywhere(_ranks(session), name, path)
    except RolloutFailed as exc:
        raise LoraChangeRefused(_client_code(exc.code), str(exc)) from exc
    session.lora_adapters[name] = path
    return adapters


async def unload_adapter(session: SchedulerSession, name: str) -> list[str]:
    if name not in session.lora_adapters:
        raise LoraChangeRefused(grpc.StatusCode.NOT_FOUND, f"no LoRA adapter named {name!r} is loaded")
    core = session.core()
    in_use = sum(r.lora_name == name for r in (*core.running, *core.waiting))
    if in_use:
        raise LoraChangeRefused(grpc.StatusCode.FAILED_PRECONDITION,
                                f"LoRA adapter {name!r} is in use by {in_use} requests")
    del session.lora_adapters[name]  # no new request takes it from now on
    try:
        adapters = await unload_everywhere(_ranks(session), name)
    except RolloutFailed as exc:
        raise LoraChangeRefused(_client_code(exc.code), str(exc)) from exc
    return adapters


async def restore_adapters(session: SchedulerSession, infos: Sequence[worker_pb2.GetWorkerInfoResponse]) -> list[str]:
    """The group's ranks are back, as `infos` describe them: a restarted one holds only the
    adapters of its own --lora-modules, or none. Before any plan reaches them, every rank is given
    the adapters the group serves (start-up and run-time ones alike) that it lacks, and made to
    forget any the group has unloaded since. Returns the adapters that could not be loaded again:
    the group serves them no longer (they are unloaded from every rank, and the caller fails the
    requests waiting for them). A rank that does not answer raises ConnectionError: the worker
    went away again."""
    ranks = _ranks(session)
    held = [set(info.lora_adapters) for info in infos]
    lost: list[str] = []
    for name, path in list(session.lora_adapters.items()):
        lacking = [rank for rank, names in zip(ranks, held, strict=True) if name not in names]
        if not lacking:
            continue
        try:
            await load_everywhere(lacking, name, path)
        except RolloutFailed as exc:
            if _client_code(exc.code) == grpc.StatusCode.UNAVAILABLE:
                raise ConnectionError(str(exc)) from exc
            logger.error("LoRA adapter %s could not be loaded again (%s); this group serves it no longer", name, exc)
            await _unload_quietly([rank for rank, names in zip(ranks, held, strict=True) if name in names], name)
            del session.lora_adapters[name]
            lost.append(name)
    for rank, names in zip(ranks, held, strict=True):
        for name in sorted(names - session.lora_adapters.keys()):
            await _unload_quietly([rank], name)
    return lost


async def _unload_quietly(ranks: list[tuple[str, object]], name: str) -> None:
    """An adapter the group no longer serves, off these ranks: no request names it, so one a rank
    keeps only costs host memory (said in the log)."""
    try:
        await unload_everywhere(ranks, name)
    except RolloutFailed as exc:
        logger.warning("unloading LoRA adapter %s from %s failed: %s", name, exc.where, exc.detail)


def _client_code(code: grpc.StatusCode) -> grpc.StatusCode:
    """A worker's refusal of the adapter keeps its code; a worker that did not answer is UNAVAILABLE."""
    keep = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND)
    return code if code in keep else grpc.StatusCode.UNAVAILABLE
