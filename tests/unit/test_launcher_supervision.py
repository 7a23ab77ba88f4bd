"""`vmesh serve`'s supervision without a mesh: a dead service is started again on the ports it
had, after a backoff that grows only while it keeps dying soon after serving; --fail-fast stops
instead."""
from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.eventually import eventually
from vmesh.services import launcher
from vmesh.services.common.runtime.retry import Backoff
from vmesh.services.launcher import ChildDied, Mesh, StopRequested


def sleeper(*_: object) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


class Supervised(Mesh):
    """Children are sleeping processes; serving is immediate; spawns are recorded."""

    def __init__(self, tmp_path: Path, fail_fast: bool = False, restart_backoff: Backoff = launcher.RESTART_BACKOFF):
        super().__init__(argparse.Namespace(log_level="INFO", metrics=True, fail_fast=fail_fast), tmp_path,
                         restart_backoff)
        self.spawned: list[list[str]] = []

    def _spawn(self, service, argv, ready, env):
        self.spawned.append(list(argv))
        return sleeper()

    async def _serving(self, child, deadline):
        child.serving_since = time.monotonic()


def test_a_dead_service_is_restarted_on_its_ports_with_growing_backoff(tmp_path, monkeypatch):
    monkeypatch.setattr(launcher, "SUPERVISE_INTERVAL_S", 0.01)

    async def main(mesh: Supervised) -> list[float]:
        child = mesh.start("frontend", "frontend", ["--http-port", "0"])
        child.address, child.http_address = "127.0.0.1:5005", "127.0.0.1:8008"
        child.metrics_address, child.health_address = "127.0.0.1:9009", "127.0.0.1:7007"
        await mesh._serving(child, 0)
        changes: list[float] = []
        supervisor = asyncio.create_task(mesh.supervise(on_change=lambda: changes.append(time.monotonic())))
        delays = []
        for restarts in (1, 2, 3):
            child.process.kill()
            started = time.monotonic()
            await eventually(lambda restarts=restarts: child.restarts >= restarts and not child.restarting)
            delays.append(time.monotonic() - started)
        mesh.stop_requested = True
        with pytest.raises(StopRequested):
            await supervisor
        assert len(changes) == 3
        return delays

    mesh = Supervised(tmp_path, restart_backoff=Backoff(0.01, factor=2.0))
    try:
        delays = asyncio.run(main(mesh))
    finally:
        mesh.stop()
    # Dying right after serving each time: 0.01, 0.02, 0.04 s of backoff (plus the supervisor's tick).
    assert delays[0] >= 0.01 and delays[1] >= 0.02 and delays[2] >= 0.04
    assert mesh.children[0].quick_deaths == 3
    restarted = mesh.spawned[-1]
    for flag, port in (("--port", "5005"), ("--http-port", "8008"), ("--metrics-port", "9009"),
                       ("--health-port", "7007")):
        assert restarted[restarted.index(flag) + 1] == port, flag
    assert mesh.spawned[0][mesh.spawned[0].index("--port") + 1] == "0"


def test_a_service_that_served_long_enough_restarts_after_the_first_backoff(monkeypatch):
    child = launcher.Child("worker", "worker", None, Path("x"), [], "127.0.0.1", {})  # type: ignore[arg-type]
    child.quick_deaths = 5
    child.serving_since = time.monotonic() - launcher.STABLE_AFTER_S - 1
    assert child.restart_delay() == launcher.RESTART_BACKOFF_S and child.quick_deaths == 0
    child.serving_since = None  # died while loading: counts as quick
    assert child.restart_delay() == launcher.RESTART_BACKOFF_S and child.quick_deaths == 1
    assert child.restart_delay() == 2 * launcher.RESTART_BACKOFF_S
    child.quick_deaths = 50
    assert child.restart_delay() == launcher.RESTART_BACKOFF_MAX_S


def test_fail_fast_raises_on_the_first_death(tmp_path, monkeypatch):
    monkeypatch.setattr(launcher, "SUPERVISE_INTERVAL_S", 0.01)
    mesh = Supervised(tmp_path, fail_fast=True)

    async def main() -> None:
        child = mesh.start("scheduler", "scheduler", [])
        child.process.kill()
        with pytest.raises(ChildDied, match="scheduler"):
            await mesh.supervise(on_change=lambda: None)

    try:
        asyncio.run(main())
    finally:
        mesh.stop()
    assert len(mesh.spawned) == 1


def test_workers_on_one_machine_share_its_cores():
    """Tensor-parallel ranks and data-parallel groups each get their share of the cores; a lone
    worker, or one whose operator chose OMP_NUM_THREADS, is left alone."""
    from vmesh.services.launcher import worker_threads

    assert worker_threads(2, 1, {}) == {}
    assert worker_threads(2, 2, {}) == {"OMP_NUM_THREADS": "1"}  # two groups, or two ranks
    assert worker_threads(16, 3, {}) == {"OMP_NUM_THREADS": "5"}
    assert worker_threads(2, 6, {}) == {"OMP_NUM_THREADS": "1"}
    assert worker_threads(16, 4, {"OMP_NUM_THREADS": "8"}) == {}
