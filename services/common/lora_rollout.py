"""One LoRA load or unload over many peers, all or none: a scheduler over its worker ranks, a
frontend over its scheduler groups (each of which does the same over its ranks).

A load goes to each peer in turn; the first failure unloads it again from the peers that had
taken it and raises `RolloutFailed`, naming the peer and its answer, so that no peer serves an
adapter another lacks. An unload goes to every peer whatever happens on one, and reports the
first failure after trying them all (an adapter gone from some peers is gone from the mesh: the
frontends stop listing it either way)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import grpc

from vmesh.v1 import common_pb2

logger = logging.getLogger(__name__)

LORA_RPC_TIMEOUT_S = 120.0  # reading an adapter's files on every rank of every group


class RolloutFailed(Exception):
    def __init__(self, where: str, code: grpc.StatusCode, detail: str):
        super().__init__(f"{where}: {detail}")
        self.where = where
        self.code = code
        self.detail = detail


async def load_everywhere(peers: Sequence[tuple[str, Any]], name: str, path: str,
                          timeout: float = LORA_RPC_TIMEOUT_S) -> list[str]:
    """`peers`: (where, stub with LoadLoraAdapter/UnloadLoraAdapter). Returns the adapters the
    last peer holds afterwards."""
    request = common_pb2.LoraAdapterRequest(lora_name=name, lora_path=path)
    loaded: list[tuple[str, Any]] = []
    adapters: list[str] = []
    for where, stub in peers:
        try:
            adapters = list((await stub.LoadLoraAdapter(request, timeout=timeout)).lora_adapters)
        except grpc.aio.AioRpcError as exc:
            for undo_where, undo_stub in reversed(loaded):
                try:
                    await undo_stub.UnloadLoraAdapter(request, timeout=timeout)
                except grpc.aio.AioRpcError as undo_exc:
                    logger.error("rolling back LoRA adapter %s on %s failed: %s", name, undo_where, undo_exc.details())
            raise RolloutFailed(where, exc.code(), exc.details() or exc.code().name) from exc
        loaded.append((where, stub))
    return adapters


async def unload_everywhere(peers: Sequence[tuple[str, Any]], name: str,
                            timeout: float = LORA_RPC_TIMEOUT_S) -> list[str]:
    request = common_pb2.LoraAdapterRequest(lora_name=name)
    failure: RolloutFailed | None = None
    adapters: list[str] = []
    for where, stub in peers:
        try:
            adapters = list((await stub.UnloadLoraAdapter(request, timeout=timeout)).lora_adapters)
        except grpc.aio.AioRpcError as exc:
            failure = failure or RolloutFailed(where, exc.code(), exc.details() or exc.code().name)
    if failure is not None:
        raise failure
    return adapters
