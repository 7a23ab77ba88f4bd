from __future__ import annotations

import asyncio

import pytest

from vmesh.services.bench.mesh import start_mesh
from vmesh.v1 import scheduler_pb2, scheduler_pb2_grpc


@pytest.fixture(scope="module")
def default_mesh():
    """Async scheduling, stateful worker, two detokenizer replicas: the shipped configuration."""
    mesh = start_mesh("--detokenizers", "2")
    yield mesh
    mesh.stop()


@pytest.fixture(scope="package")
def plain_mesh():
    """`vmesh serve` with nothing but its defaults, shared by the modules that ask for no flag (one
    start for all of them, stopped after the last e2e test)."""
    mesh = start_mesh()
    yield mesh
    mesh.stop()


def scheduler_stats(mesh, name: str = "scheduler") -> scheduler_pb2.GetSchedulerStatsResponse:
    async def ask():
        async with mesh.channel(name) as ch:  # as the run's admin: internal ports take mutual TLS
            return await scheduler_pb2_grpc.SchedulerServiceStub(ch).GetSchedulerStats(
                scheduler_pb2.GetSchedulerStatsRequest(), timeout=10)

    return asyncio.run(ask())


def wait_idle(mesh, timeout: float = 20, name: str = "scheduler") -> scheduler_pb2.GetSchedulerStatsResponse:
    """The scheduler's stats once nothing runs or waits (aborts travel asynchronously)."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        stats = scheduler_stats(mesh, name)
        if (stats.num_running == 0 and stats.num_waiting == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


