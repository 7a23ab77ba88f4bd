"""Peak proportional set size (PSS) of running processes, sampled while a benchmark runs.

PSS divides shared pages among the processes that map them, so the figures of a mesh's
services add up to what the mesh costs the machine (Linux only: /proc/PID/smaps_rollup)."""

from __future__ import annotations

import threading
from pathlib import Path
from types import TracebackType

SAMPLE_INTERVAL_S = 0.25


def pss_mib(pid: int) -> float | None:
    """The PSS of the process and every process it started, now, in MiB (engines such as
    vLLM's run their model in child processes); None once it is gone (or without smaps)."""
    try:
        total = 0.0
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                total = int(line.split()[1]) / 1024
    except OSError:
        return None
    return total + sum(pss_mib(child) or 0.0 for child in _children(pid))


def _children(pid: int) -> list[int]:
    children: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            children += [int(c) for c in (task / "children").read_text().split()]
    except OSError:
        pass
    return children


class PeakPss:
    """`with PeakPss({"worker": pid, ...}) as peaks: ...` then `peaks.mib` holds each name's peak."""

    def __init__(self, pids: dict[str, int], interval_s: float = SAMPLE_INTERVAL_S):
        self.pids = pids
        self.interval_s = interval_s
        self.mib: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_until_stopped, name="pss-sampler", daemon=True)

    def _sample(self) -> None:
        for name, pid in self.pids.items():
            now = pss_mib(pid)
            if now is not None and now > self.mib.get(name, 0.0):
                self.mib[name] = now

    def _sample_until_stopped(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> PeakPss:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
