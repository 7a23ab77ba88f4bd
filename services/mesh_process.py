"""Run `vmesh serve` as a child process tree on loopback (for tests and benchmarks) and stop it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 240


@dataclass
class RunningMesh:
    process: subprocess.Popen
    address: str
    services: dict[str, tuple[str, int]]  # name -> (address, pid)
    metrics: dict[str, str] = field(default_factory=dict)  # name -> metrics URL, with --metrics
    output: list[str] = field(default_factory=list)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def kill_service(self, name: str) -> None:
        os.kill(self.services[name][1], signal.SIGKILL)

    def wait_for_output(self, pattern: str, timeout: float = 30) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.output):
                if re.search(pattern, line):
                    return line
            time.sleep(0.1)
        raise AssertionError(f"no output matching {pattern!r}; got:\n" + "".join(self.output[-30:]))


def start_mesh(*flags: str, env: dict[str, str] | None = None) -> RunningMesh:
    """`env`: extra environment variables for every service (e.g. OTEL_*)."""
    command = [sys.executable, "-m", "services.cli", "--log-level", "WARNING", "serve", "--port", "0",
               "--kv-cache-memory", "128MiB", *flags]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, **(env or {})})
    output: list[str] = []
    services: dict[str, tuple[str, int]] = {}
    metrics: dict[str, str] = {}
    address = None
    deadline = time.monotonic() + START_TIMEOUT_S
    while address is None:
        line = process.stdout.readline()
        if not line:
            raise RuntimeError("vmesh serve exited during start-up:\n" + "".join(output))
        output.append(line)
        if m := re.match(r"vmesh: (\S+) at (\S+) \(pid (\d+)(?:, metrics (\S+))?\)", line):
            services[m.group(1)] = (m.group(2), int(m.group(3)))
            if m.group(4):
                metrics[m.group(1)] = m.group(4)
        if m := re.match(r"vmesh: serving on (\S+)", line):
            address = m.group(1)
        if time.monotonic() > deadline:
            process.kill()
            raise TimeoutError("vmesh serve did not start:\n" + "".join(output))

    def pump() -> None:
        for line in process.stdout:
            output.append(line)

    threading.Thread(target=pump, daemon=True).start()
    return RunningMesh(process, address, services, metrics, output)
