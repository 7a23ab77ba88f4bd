"""A service's event loop serves every client, so no single turn of it may grow with a flood:
deadline closes go a bounded batch per turn, and what a service built while starting is exempt
from the garbage collector's full passes (their length grows with the heap, not the load)."""

from __future__ import annotations

import asyncio
import gc

from vmesh.services.common.grpc_server import ServiceShell, wait_until_serving
from vmesh.services.common.server_settings import ServerSettings
from vmesh.services.frontend.http_connections import CLOSES_PER_LOOP_TURN, BoundedCloser
from vmesh.v1 import frontend_pb2


class _Transport:
    def __init__(self, log: list[tuple[int, int]], turn: list[int], index: int):
        self.log, self.turn, self.index = log, turn, index
        self.closed = False

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True
        self.log.append((self.turn[0], self.index))


def test_deadline_closes_are_spread_over_loop_turns_oldest_first():
    async def run() -> tuple[list[tuple[int, int]], list[_Transport]]:
        log: list[tuple[int, int]] = []
        turn = [0]
        transports = [_Transport(log, turn, i) for i in range(5 * CLOSES_PER_LOOP_TURN + 3)]
        transports[7].closed = True  # closed by its client meanwhile: not closed twice
        closer = BoundedCloser()
        for transport in transports:
            closer.close(transport)  # type: ignore[arg-type]
        while closer.pending or closer.scheduled:
            turn[0] += 1
            await asyncio.sleep(0)
        return log, transports

    log, transports = asyncio.run(run())
    assert all(t.closed for t in transports)
    assert [index for _, index in log] == [i for i in range(len(transports)) if i != 7]
    per_turn: dict[int, int] = {}
    for turn, _ in log:
        per_turn[turn] = per_turn.get(turn, 0) + 1
    assert max(per_turn.values()) == CLOSES_PER_LOOP_TURN and len(per_turn) == 6


def test_what_a_service_builds_while_starting_is_exempt_from_full_collections():
    built_while_starting: list[object] = []
    seen_while_serving: list[bool] = []

    async def run() -> None:
        shell = ServiceShell("frontend", frontend_pb2.DESCRIPTOR.services_by_name["FrontendService"],
                             ServerSettings())

        async def warm_up() -> None:
            built_while_starting.append(["a tokenizer's tables, say"])

        async def drain() -> None:
            seen_while_serving.append(any(o is built_while_starting[0] for o in gc.get_objects()))

        running = asyncio.ensure_future(shell.run(warm_up, drain))
        await wait_until_serving(shell.address, 30)
        shell.stopping.set()
        await running

    try:
        asyncio.run(run())
    finally:
        gc.unfreeze()
    assert seen_while_serving == [False]
