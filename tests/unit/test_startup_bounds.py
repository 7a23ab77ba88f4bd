"""Every start-up wait has a deadline that fires: the launcher's output reader, the health
probe, and the bind of a port that is already taken."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vmesh.services.bench.mesh import read_until_serving
from vmesh.services.common.grpc_server import ServiceShell, wait_until_serving
from vmesh.services.common.server_settings import ServerSettings
from vmesh.v1 import frontend_pb2


def test_silent_launcher_times_out_and_is_killed(tmp_path):
    process = subprocess.Popen([sys.executable, "-c", "import time; print('starting', flush=True); time.sleep(60)"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="did not start within 1 s") as error:
        read_until_serving(process, tmp_path / "ready", timeout=1.0, on_timeout=lambda pid: f"\nstacks of {pid}")
    assert time.monotonic() - started < 10
    assert process.poll() is not None, "the launcher is killed on a time-out"
    assert "starting" in str(error.value) and f"stacks of {process.pid}" in str(error.value)


def test_launcher_that_exits_during_start_is_reported(tmp_path):
    process = subprocess.Popen([sys.executable, "-c", "print('boom')"], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    with pytest.raises(RuntimeError, match="exited during start-up:\nboom"):
        read_until_serving(process, tmp_path / "ready", timeout=30)


def test_health_probe_of_a_peer_that_never_answers_times_out():
    """A listener that accepts but never speaks HTTP/2: each check is bounded on the event loop."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="did not become healthy within 1 s"):
            asyncio.run(wait_until_serving(address, 1.0))
        assert time.monotonic() - started < 10
    finally:
        listener.close()


def test_a_taken_port_is_refused():
    """Without SO_REUSEPORT a second server cannot bind the port and split the first's clients."""
    async def run() -> None:
        descriptor = frontend_pb2.DESCRIPTOR.services_by_name["FrontendService"]
        first = ServiceShell("frontend", descriptor, ServerSettings())
        await first.server.start()
        try:
            with pytest.raises((OSError, RuntimeError)):
                ServiceShell("frontend", descriptor, ServerSettings(port=first.port))
        finally:
            await first.server.stop(None)

    asyncio.run(run())


def test_launched_service_dies_with_its_launcher():
    """die_with_launcher: a service whose launcher dies gets SIGTERM and goes, however the
    launcher died (here it just exits without stopping its child)."""
    child = ("from vmesh.services.launcher import die_with_launcher\n"
             "die_with_launcher()\nprint('armed', flush=True)\nimport time\ntime.sleep(60)")
    launcher = ("import os, subprocess, sys\n"
                f"child = subprocess.Popen([sys.executable, '-c', {child!r}], stdout=subprocess.PIPE, text=True,\n"
                "                         env={**os.environ, 'VMESH_LAUNCHER_PID': str(os.getpid())})\n"
                "assert child.stdout.readline().strip() == 'armed'\n"
                "print(child.pid, flush=True)\n")  # and exit, leaving the child behind
    result = subprocess.run([sys.executable, "-c", launcher], capture_output=True, text=True, timeout=60)
    child_pid = int(result.stdout.split()[0])
    deadline = time.monotonic() + 20
    while _alive(child_pid):
        assert time.monotonic() < deadline, "the service outlived its launcher"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    state = next(line for line in status.splitlines() if line.startswith("State:"))
    return "Z" not in state.split()[1]  # a zombie has exited, waiting for whoever adopted it


def test_a_service_whose_launcher_is_already_gone_exits():
    script = ("import os; os.environ['VMESH_LAUNCHER_PID'] = str(2**22 + 1)\n"
              "from vmesh.services.launcher import die_with_launcher\n"
              "die_with_launcher()\nprint('still here')")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "still here" not in result.stdout
