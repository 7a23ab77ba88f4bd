"""Stand-ins for the grpc.aio objects a servicer touches, so that service shells can be
driven in unit tests without a network."""
from __future__ import annotations

import asyncio

import grpc


class Aborted(Exception):
    """What FakeContext.abort raises (grpc.aio raises its own AbortError the same way)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code = code


class FakeContext:
    """A servicer context: abort raises Aborted, no deadline, metadata goes nowhere."""

    async def abort(self, code: grpc.StatusCode, details: str):
        raise Aborted(code, details)

    def time_remaining(self) -> float | None:
        return None

    async def send_initial_metadata(self, metadata) -> None:
        pass

    def invocation_metadata(self) -> tuple:
        return ()


class FakeChannel:
    closed = False

    async def close(self) -> None:
        self.closed = True


class FakeStream:
    """Behaves like a grpc.aio stream-stream call: one write at a time (a second write in flight
    fails the call), reads that wait for responses or a failure."""

    def __init__(self) -> None:
        self.writing = False
        self.received: list[list[int]] = []  # each written message's handles
        self.messages: list = []  # the messages themselves
        self.responses: asyncio.Queue = asyncio.Queue()
        self.cancelled = False
        self.ended: grpc.aio.AioRpcError | None = None  # set: the call ended with this status, unread

    def done(self) -> bool:
        return self.cancelled or self.ended is not None

    def refuse_if_done(self) -> None:
        """What a finished grpc.aio call does with a write."""
        if self.done():
            raise asyncio.InvalidStateError("RPC already finished.")

    async def wait_for_connection(self) -> None:
        await asyncio.sleep(0)

    async def write(self, message) -> None:
        self.refuse_if_done()
        if self.writing:
            raise RuntimeError("GRPC_CALL_ERROR_TOO_MANY_OPERATIONS")
        self.writing = True
        try:
            for _ in range(3):  # the transport yields while the message goes out
                await asyncio.sleep(0)
            self.received.append(list(message.handles))
            self.messages.append(message)
        finally:
            self.writing = False

    async def read(self):
        if self.ended is not None:
            raise self.ended
        response = await self.responses.get()
        if isinstance(response, Exception):
            raise response
        return response

    def cancel(self) -> None:
        self.cancelled = True


def rpc_error(code: grpc.StatusCode, details: str = "") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details or code.name)


async def healthy_forever(group):
    """A scheduler's health stream that never breaks (SchedulerPool's health_stream)."""
    import asyncio

    await asyncio.Event().wait()
    yield  # pragma: no cover


def listening(frontend, *addresses: str) -> None:
    """Mark the frontend subscribed to these detokenizer replicas, without a network or a task
    (as if each subscription had opened)."""
    from vmesh.services.frontend.subscriptions import Subscription

    for address in addresses:
        frontend.replicas.members[address] = Subscription(address, alive=True)
