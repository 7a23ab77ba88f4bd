"""LoRA adapters as the frontend sees them: the models it serves besides the base model, and the
mesh-wide load and unload behind vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter.

The frontend lists (and accepts requests for) an adapter only once every scheduler group it uses
holds it, so a request for it may go to any group. A load goes to every group, each loading it
on all its worker ranks, and is undone everywhere if any of them fails
(services/common/lora_rollout.py). Another frontend learns of an adapter the first time a
request names it (or /v1/models is asked): it asks its groups again before refusing a name."""

from __future__ import annotations

import asyncio

import grpc

from vmesh.services.common.lora_rollout import RolloutFailed, load_everywhere, unload_everywhere
from vmesh.services.frontend.errors import RequestError
from vmesh.services.frontend.schedulers import SchedulerGroup, SchedulerPool
from vmesh.v1 import scheduler_pb2

STATS_TIMEOUT_S = 5.0
# What a client is told for each code the groups answered with: a refusal of the adapter is the
# client's to fix; a group that did not answer is unavailable.
_CLIENT_CODES = {grpc.StatusCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
                 grpc.StatusCode.ALREADY_EXISTS: grpc.StatusCode.INVALID_ARGUMENT,
                 grpc.StatusCode.FAILED_PRECONDITION: grpc.StatusCode.INVALID_ARGUMENT,
                 grpc.StatusCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND}


class FrontendAdapters:
    def __init__(self, pool: SchedulerPool):
        self.pool = pool
        self.held: dict[str, set[str]] = {}  # per group address: the adapters it reported

    def _groups(self) -> list[SchedulerGroup]:
        return [group for group in self.pool.members.active() if group.ready]

    def listed(self) -> list[str]:
        """The adapters every usable group holds, sorted."""
        groups = self._groups()
        if not groups:
            return []
        return sorted(set.intersection(*(self.held.get(group.address, set()) for group in groups)))

    async def refresh(self) -> list[str]:
        """Ask every usable group which adapters it holds."""
        async def ask(group: SchedulerGroup) -> None:
            try:
                stats = await group.stub.GetSchedulerStats(scheduler_pb2.GetSchedulerStatsRequest(),
                                                           timeout=STATS_TIMEOUT_S)
            except grpc.aio.AioRpcError:
                return  # a group that does not answer keeps what it said last
            self.held[group.address] = set(stats.lora_adapters)

        await asyncio.gather(*(ask(group) for group in self._groups()))
        return self.listed()

    async def resolve(self, model: str, served: str) -> str:
        """The adapter a request's `model` names, or "" (the base model, or a name that is not an
        adapter, which the model check then refuses)."""
        if not model or model == served:
            return ""
        if model in self.listed() or model in await self.refresh():
            return model
        return ""

    def _peers(self) -> list[tuple[str, object]]:
        # Named by position, not address: the message reaches the client.
        return [(f"scheduler group {i}", group.stub) for i, group in enumerate(self._groups())]

    async def load(self, name: str, path: str) -> None:
        if not name or not path:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "lora_name and lora_path are both required")
        if name in await self.refresh():
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"a LoRA adapter named {name!r} is already loaded")
        try:
            await load_everywhere(self._peers(), name, path)
        except RolloutFailed as exc:
            raise _client_error("loading", name, exc) from exc
        finally:
            await self.refresh()

    async def unload(self, name: str) -> None:
        if name not in await self.refresh():
            raise RequestError(grpc.StatusCode.NOT_FOUND, f"no LoRA adapter named {name!r} is loaded")
        try:
            await unload_everywhere(self._peers(), name)
        except RolloutFailed as exc:
            raise _client_error("unloading", name, exc) from exc
        finally:
            await self.refresh()


def _client_error(doing: str, name: str, exc: RolloutFailed) -> RequestError:
    code = _CLIENT_CODES.get(exc.code, grpc.StatusCode.UNAVAILABLE)
    return RequestError(code, f"{doing} LoRA adapter {name!r} failed on {exc}; no frontend lists it")
