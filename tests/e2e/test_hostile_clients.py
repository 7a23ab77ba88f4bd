"""Clients that misbehave cost the mesh nothing lasting: thousands of deadlines and cancels at
every moment of a request's life leave nothing running, waiting or holding KV blocks."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from tests.e2e.conftest import scheduler_stats
from tests.support.scrape import scrape
from vmesh.services.bench.mesh import start_mesh
from vmesh.services.client import VmeshClient

EARLY_ENDS = 2000
IN_FLIGHT = 200  # at most this many of them at once, as a busy client pool would
LONGEST_LIFE_S = 0.05


@pytest.fixture(scope="module")
def mesh():
    mesh = start_mesh("--metrics")
    yield mesh
    mesh.stop()


def generated_tokens(mesh) -> float:
    return scrape(mesh.metrics["scheduler"])["vmesh:generation_tokens_total"]


def wait_released(mesh, timeout: float = 60):
    """The scheduler's stats once nothing runs, waits or holds a block (aborts travel
    asynchronously), or the last ones seen after `timeout`."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        stats = scheduler_stats(mesh)
        if not (stats.num_running or stats.num_waiting or stats.num_used_blocks) or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


async def _end_early(client: VmeshClient, i: int, life_s: float) -> None:
    """A long request that ends after `life_s`: by its gRPC deadline (odd i) or by the client
    cancelling it (even i), at whatever step it has reached by then."""
    stream = client.generate(text=f"Tell me a very long story, number {i % 37}", max_tokens=1500, ignore_eos=True,
                             timeout=life_s if i % 2 else None)

    async def read() -> None:
        async for _ in stream:
            pass

    if i % 2:
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await read()
        assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        return
    reading = asyncio.ensure_future(read())
    await asyncio.wait([reading], timeout=life_s)
    reading.cancel()
    await asyncio.gather(reading, return_exceptions=True)


def test_thousands_of_deadlines_and_cancels_leave_nothing_running(mesh):
    rng = random.Random(34)
    lives = [rng.uniform(0, LONGEST_LIFE_S) for _ in range(EARLY_ENDS)]

    async def main() -> None:
        slots = asyncio.Semaphore(IN_FLIGHT)
        async with VmeshClient(mesh.address) as client:
            async def one(i: int) -> None:
                async with slots:
                    await _end_early(client, i, lives[i])

            await asyncio.gather(*(one(i) for i in range(EARLY_ENDS)))

    asyncio.run(main())
    stats = wait_released(mesh)
    assert (stats.num_running, stats.num_waiting, stats.num_used_blocks) == (0, 0, 0)

    async def probe() -> None:
        async with VmeshClient(mesh.address) as client:
            await client.complete(text="Hi", max_tokens=4, ignore_eos=True)

    # Nothing generates for nobody: across a probe, only the probe's own tokens are generated.
    before = generated_tokens(mesh)
    asyncio.run(probe())
    wait_released(mesh)
    assert generated_tokens(mesh) - before == 4
