"""A service's event loop serves every client, so no single turn of it may grow with a flood:
deadline closes go a bounded batch per turn, and what a service built while starting is exempt
from the garbage collector's full passes (their length grows with the heap, not the load)."""

from __future__ import annotations

import asyncio
import gc
import itertools

from vmesh.services.common.grpc_server import ServiceShell, wait_until_serving
from vmesh.services.common.server_settings import ServerSettings
from vmesh.services.frontend.http_connections import CLOSES_PER_LOOP_TURN, BoundedCloser
from vmesh.v1 import frontend_pb2


class _Transport:
    def __init__(self, log: list[tuple[int, int]], turn: list[int], index: int):
        self.log, self.turn, self.index = log, turn, index
        self.closed = False
        self.reading = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.reading = False

    def abort(self) -> None:
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
    assert all(t.closed and not t.reading for t in transports)
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


def test_a_burst_of_connections_waits_in_the_listen_queue_and_is_accepted_a_few_per_turn():
    """100 clients connect while the loop is busy: the kernel's queue holds them all (the listen
    backlog was deepened after asyncio's listen), and the loop then makes at most
    ACCEPTS_PER_LOOP_TURN connections per turn, not the whole burst in one."""
    import socket
    import threading

    from vmesh.services.frontend.http_connections import (
        ACCEPTS_PER_LOOP_TURN,
        ConnectionGuard,
        GuardedServer,
        bind,
        guarded_config,
    )

    burst = 100

    async def app(scope, receive, send) -> None:  # never reached: the clients send nothing
        raise AssertionError(scope)

    async def run() -> tuple[list[int], list[socket.socket]]:
        guard = ConnectionGuard(head_timeout_s=60, per_peer=0, limit=10_000)
        sock = bind("127.0.0.1", 0)
        server = GuardedServer(guarded_config(app, guard, log_config=None, lifespan="off"))
        serving = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        clients: list[socket.socket] = []

        def connect_all() -> None:
            for _ in range(burst):
                clients.append(socket.create_connection(sock.getsockname(), timeout=0.5))

        connecting = threading.Thread(target=connect_all)
        connecting.start()
        connecting.join()  # the loop does not run meanwhile: only the kernel's queue can take them
        opened: list[int] = []
        while guard.open < burst and len(opened) < 10 * burst:
            opened.append(guard.open)
            await asyncio.sleep(0)
        opened.append(guard.open)
        server.should_exit = True
        for client in clients:
            client.close()
        await serving
        return opened, clients

    opened, clients = asyncio.run(run())
    assert len(clients) == burst and opened[-1] == burst
    per_turn = [b - a for a, b in itertools.pairwise(opened)]
    assert max(per_turn) <= ACCEPTS_PER_LOOP_TURN, per_turn


def test_connections_still_sending_their_head_do_not_count_toward_the_limit():
    """A slow-header flood is bounded by the head timeout and the per-peer cap; were it counted
    toward the public limit, it would get every other client a 503."""
    from vmesh.services.frontend.http_connections import ConnectionGuard

    guard = ConnectionGuard(head_timeout_s=10, per_peer=0, limit=2)
    guard.open, guard.awaiting_head = 5000, 4999
    assert not guard.over_limit
    guard.awaiting_head = 4997  # three of them sent a head: past the limit
    assert guard.over_limit
