"""Run `vmesh serve` as a child process tree on loopback and stop it: what `vmesh bench` measures,
and the harness of the checkout's end-to-end tests and benchmarks."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from vmesh.services.common.grpc_server import channel
from vmesh.services.mesh_description import MeshDescription, description_path, role_of_service

# The checkout this module lies in, when it is one (services/bench/mesh.py, resolved through the
# vmesh/services symlink): a mesh started from it runs the checkout's code, not an installed copy.
_CHECKOUT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 240
STOP_TIMEOUT_S = 60


@dataclass
class RunningMesh:
    process: subprocess.Popen
    # The launcher's answer; empty until its ready file appears (start_mesh returns after that).
    description: MeshDescription = field(default_factory=lambda: MeshDescription(address=""))
    output: list[str] = field(default_factory=list)
    description_file: Path | None = None  # the launcher's description, rewritten when it restarts a service

    # Views of the launcher's description, in the shapes callers index.
    @property
    def address(self) -> str:
        return self.description.address

    @property
    def http_url(self) -> str:
        """The OpenAI-compatible API's base URL (http://host:port/v1); "" with --no-http."""
        return self.description.http_url

    @property
    def certificates(self) -> str:
        """The run's CA and admin certificate; "" with --no-internal-tls."""
        return self.description.certificates

    def channel(self, name: str) -> grpc.aio.Channel:
        """A channel to the internal service `name` (scheduler, worker-rank0, detokenizer-1, ...)
        as the run's admin, as operator tools reach it: mutual TLS, unless the mesh runs
        --no-internal-tls."""
        return channel(self.services[name][0], role_of_service(name), identity=self.description.admin_identity())

    @property
    def services(self) -> dict[str, tuple[str, int]]:
        """name -> (address, pid)"""
        return {name: (entry.address, entry.pid) for name, entry in self.description.services.items()}

    @property
    def metrics(self) -> dict[str, str]:
        """name -> metrics URL, with --metrics"""
        return {name: entry.metrics_url for name, entry in self.description.services.items() if entry.metrics_url}

    @property
    def restarts(self) -> dict[str, int]:
        """name -> times the launcher restarted it"""
        return {name: entry.restarts for name, entry in self.description.services.items()}

    def refresh(self) -> None:
        """Read the launcher's description again (pids and restart counts change on a restart)."""
        if self.description_file is not None and self.description_file.exists():
            self.description = MeshDescription.from_json(self.description_file.read_text())

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.kill()
        self._forget_answers()
        return self.process.returncode

    def _forget_answers(self) -> None:
        if self.description_file is not None:
            shutil.rmtree(self.description_file.parent, ignore_errors=True)

    def kill(self) -> None:
        """The launcher and every service it started, at once: they share the launcher's process
        group, so even services the launcher had not announced yet go too."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        for pid in [self.process.pid, *(pid for _, pid in self.services.values())]:
            _kill_quietly(pid)
        self.process.wait()
        self._forget_answers()

    def kill_service(self, name: str) -> int:
        """SIGKILL the service's current process (a restarted one has a new pid); returns the pid."""
        self.refresh()
        pid = self.services[name][1]
        os.kill(pid, signal.SIGKILL)
        return pid

    def wait_for_output(self, pattern: str, timeout: float = 30) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.output):
                if re.search(pattern, line):
                    return line
            time.sleep(0.1)
        raise AssertionError(f"no output matching {pattern!r}; got:\n" + "".join(self.output[-30:]))


def _kill_quietly(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def start_mesh(*flags: str, env: dict[str, str] | None = None, timeout: float = START_TIMEOUT_S,
               on_timeout: Callable[[int], str] | None = None, prefix: Sequence[str] = (),
               vmesh: Sequence[str] = (sys.executable, "-m", "vmesh"), cwd: Path | None = None,
               log_level: str = "WARNING") -> RunningMesh:
    """`env`: extra environment variables for every service (e.g. OTEL_*). Raises TimeoutError,
    with the launcher's output, when the mesh is not serving within `timeout` seconds; the
    launcher is then killed (its children follow it: they die with their parent), after
    `on_timeout(launcher_pid)` has added what it reports to the error. `prefix`: a command that
    execs the launcher's (e.g. one that switches to another user). `vmesh`: the command to run
    (another installation's `vmesh`, say); `cwd`: where (default: the checkout, if this is one).
    `log_level`: every service's, as their output joins the launcher's (`wait_for_output`)."""
    answers = Path(tempfile.mkdtemp(prefix="vmesh-mesh-"))
    if prefix:  # the launcher may run as another user, who must be able to write its answer here
        answers.chmod(0o777)
    ready_file = answers / "ready"
    command = [*prefix, *vmesh, "--log-level", log_level, "serve", "--port", "0", "--http-port", "0",
               "--kv-cache-memory", "128MiB", "--ready-file", str(ready_file), *flags]
    if cwd is None and (_CHECKOUT / "pyproject.toml").is_file():
        cwd = _CHECKOUT
    # Its own process group, which its services join: one signal reaches all of them.
    process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, **(env or {})}, start_new_session=True)
    try:
        return read_until_serving(process, ready_file, timeout, on_timeout)
    except BaseException:
        shutil.rmtree(answers, ignore_errors=True)
        raise


def read_until_serving(process: subprocess.Popen, ready_file: Path, timeout: float,
                       on_timeout: Callable[[int], str] | None = None) -> RunningMesh:
    """Follow a launcher until its ready file appears (its description beside it, written
    first), within `timeout` seconds; its output is kept for errors and `wait_for_output`."""
    output: list[str] = []
    assert process.stdout is not None, "started with stdout=PIPE"
    stdout = process.stdout

    def pump() -> None:
        # Reading in a thread from the start keeps the deadline below in force even while the
        # launcher prints nothing (a blocking readline would wait forever).
        for line in stdout:
            output.append(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    mesh = RunningMesh(process, output=output)
    deadline = time.monotonic() + timeout
    while not ready_file.exists():
        if process.poll() is not None:
            reader.join(timeout=5)  # the rest of what it printed
            raise RuntimeError("vmesh serve exited during start-up:\n" + "".join(output))
        if time.monotonic() > deadline:
            report = ""
            try:
                report = on_timeout(process.pid) if on_timeout else ""
            except Exception as exc:  # the report is a courtesy; the kill is not
                report = f"\n(no report: {exc})"
            finally:
                mesh.kill()
            raise TimeoutError(f"vmesh serve did not start within {timeout:.0f} s:\n" + "".join(output)
                               + report) from None
        time.sleep(0.05)
    mesh.description_file = description_path(ready_file)
    mesh.refresh()
    return mesh
