"""A scheduler group's LoRA adapters: which its workers hold, and a load or unload on every
worker rank of the group at once (services/common/lora_rollout.py), refused while a request of
the group still uses the adapter."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from vmesh.services.common.lora_rollout import RolloutFailed, load_everywhere, unload_everywhere

if TYPE_CHECKING:
    from vmesh.services.scheduler.session import SchedulerSession


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
    session.lora_adapters = set(adapters)
    return adapters


async def unload_adapter(session: SchedulerSession, name: str) -> list[str]:
    if name not in session.lora_adapters:
        raise LoraChangeRefused(grpc.StatusCode.NOT_FOUND, f"no LoRA adapter named {name!r} is loaded")
    core = session.core()
    in_use = sum(r.lora_name == name for r in (*core.running, *core.waiting))
    if in_use:
        raise LoraChangeRefused(grpc.StatusCode.FAILED_PRECONDITION,
                                f"LoRA adapter {name!r} is in use by {in_use} requests")
    session.lora_adapters.discard(name)  # no new request takes it from now on
    try:
        adapters = await unload_everywhere(_ranks(session), name)
    except RolloutFailed as exc:
        raise LoraChangeRefused(_client_code(exc.code), str(exc)) from exc
    session.lora_adapters = set(adapters)
    return adapters


def _client_code(code: grpc.StatusCode) -> grpc.StatusCode:
    """A worker's refusal of the adapter keeps its code; a worker that did not answer is UNAVAILABLE."""
    keep = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND)
    return code if code in keep else grpc.StatusCode.UNAVAILABLE
