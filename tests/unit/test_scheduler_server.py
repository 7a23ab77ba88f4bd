"""The scheduler service's detokenizer fan-out, driven without a network."""
from __future__ import annotations

import asyncio

from services.scheduler.server import MeshSchedulerConfig, SchedulerServicer


class OneWriteAtATimeStream:
    """Behaves like a grpc.aio stream-stream call: a write while another is in flight fails the call."""

    def __init__(self) -> None:
        self.writing = False
        self.received: list[list[int]] = []

    async def write(self, message) -> None:
        if self.writing:
            raise RuntimeError("GRPC_CALL_ERROR_TOO_MANY_OPERATIONS")
        self.writing = True
        try:
            for _ in range(3):  # the transport yields while the message goes out
                await asyncio.sleep(0)
            self.received.append(list(message.handles))
        finally:
            self.writing = False


def test_concurrent_flushes_write_one_at_a_time_and_in_order():
    servicer = SchedulerServicer(MeshSchedulerConfig(worker_addresses=[], detokenizer_addresses=["127.0.0.1:1"]))
    replica = servicer.replicas[0]
    replica.call = stream = OneWriteAtATimeStream()
    replica.alive = True

    async def main() -> None:
        flushes = []
        for handle in range(6):  # abort RPCs and the engine loop each flush whatever is pending, concurrently
            replica.pending.handles.append(handle)
            flushes.append(asyncio.create_task(servicer._flush_replicas()))
            await asyncio.sleep(0)
        await asyncio.gather(*flushes)

    asyncio.run(main())
    assert replica.alive
    assert stream.received == [[h] for h in range(6)]
