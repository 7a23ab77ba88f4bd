"""Stand-ins for the grpc.aio objects a servicer touches, so that service shells can be
driven in unit tests without a network."""
from __future__ import annotations

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


def rpc_error(code: grpc.StatusCode, details: str = "") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details or code.name)


async def healthy_forever(group):
    """A scheduler's health stream that never breaks (SchedulerPool's health_stream)."""
    import asyncio

    await asyncio.Event().wait()
    yield  # pragma: no cover
