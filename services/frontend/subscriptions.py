"""The frontend's subscription to one detokenizer replica, over which the outputs of every request
the replica serves for this frontend arrive."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from vmesh.services.common import tls
from vmesh.services.common.grpc_server import channel
from vmesh.services.common.runtime.peers import Peer
from vmesh.services.common.types import OutputBatch
from vmesh.services.common.wire import outputs
from vmesh.v1 import detokenizer_pb2, detokenizer_pb2_grpc

# (frontend id, replica address, where its output batches go, what to call once it is open):
# one subscription, read until it breaks.
Subscribe = Callable[[str, str, Callable[[OutputBatch], None], Callable[[], None]], Awaitable[None]]


@dataclass
class Subscription(Peer):
    """This frontend's subscription to one detokenizer replica, kept open (reopened after a
    break) by its task for as long as the replica is listed or still serves a request.
    `alive`: the subscription is open now; `joined`: it opened once (or the replica left)."""


async def subscribe_over_grpc(frontend_id: str, address: str, dispatch: Callable[[OutputBatch], None],
                              opened: Callable[[], None], identity: tls.Identity | None = None) -> None:
    """One subscription to a replica, read until it breaks (its requests then fail over).
    `identity`: this frontend's, when the mesh uses mutual TLS."""
    async with channel(address, "detokenizer", identity=identity) as ch:
        stub = detokenizer_pb2_grpc.DetokenizerServiceStub(ch)
        call = stub.Subscribe(detokenizer_pb2.SubscribeRequest(frontend_id=frontend_id), wait_for_ready=True)
        # The replica sends metadata once it has registered us.
        await call.initial_metadata()
        opened()
        async for batch in call:
            dispatch(outputs.from_proto(batch))
        raise ConnectionError("subscription closed")
