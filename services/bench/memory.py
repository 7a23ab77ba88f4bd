"""Peak proportional set size (PSS) of running processes over a benchmark's timed runs.

PSS divides shared pages among the processes that map them, so the figures of a mesh's
services add up to what the mesh costs the machine (Linux only: /proc/PID/smaps_rollup).

Reading smaps_rollup walks the process's page tables under its memory map lock: ~13 ms of
kernel time for a 1.6 GiB worker, during which the worker's own mappings (a large tensor's
allocation) wait. Sampled four times a second over two meshes and a peer, that took a quarter
of a core from the runs it measured and slowed them unevenly. So PeakPss reads nothing while
the runs go: it resets each process's resident high-water mark when they start and reads PSS,
resident size and that mark once when they end. Pages resident at the peak but gone at the end
were freed during the runs (activations, scratch), which are private to their process, so they
count fully: peak PSS = PSS at the end + (high-water mark - resident size at the end). Two ways
this overstates: file pages the kernel reclaimed during the runs count as if freed, and a process
tree's figure sums each member's own peak, which need not have come at the same moment."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

logger = logging.getLogger(__name__)


def _kib_fields(path: Path, names: tuple[str, ...]) -> dict[str, int]:
    """The "Name: N kB" lines of a /proc file whose names are in `names`, in KiB."""
    found: dict[str, int] = {}
    for line in path.read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in names:
            found[name] = int(rest.split()[0])
    return found


def _own_pss_mib(pid: int) -> float:
    return _kib_fields(Path(f"/proc/{pid}/smaps_rollup"), ("Pss",)).get("Pss", 0) / 1024


def _tree(pid: int) -> list[int]:
    """The process and every process it started (engines such as vLLM's run their model in
    child processes)."""
    children: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            children += [int(c) for c in (task / "children").read_text().split()]
    except OSError:
        pass
    return [pid, *(p for child in children for p in _tree(child))]


def _tree_sum(pid: int, figure: Callable[[int], float]) -> float | None:
    """`figure` summed over the process and every process it started; None once the process is
    gone (a child that ends meanwhile counts nothing)."""
    total = 0.0
    for number, member in enumerate(_tree(pid)):
        try:
            total += figure(member)
        except OSError:
            if number == 0:
                return None
    return total


def pss_mib(pid: int) -> float | None:
    """The PSS of the process and every process it started, now, in MiB; None once it is gone
    (or without smaps)."""
    return _tree_sum(pid, _own_pss_mib)


def _reset_peak(pid: int) -> None:
    """Start the process's resident high-water mark (VmHWM) over from its resident size now
    (Linux 4.0+, and only for a process this one may trace: its own user's)."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError as exc:
        if Path(f"/proc/{pid}").exists():  # else it is gone, and has no figure anyway
            logger.warning("could not reset process %d's memory high-water mark (%s): its peak may "
                           "include what it held before the runs", pid, exc)


def _peak_pss_since_reset_mib(pid: int) -> float:
    status = _kib_fields(Path(f"/proc/{pid}/status"), ("VmHWM", "VmRSS"))
    freed_since_peak = max(0, status.get("VmHWM", 0) - status.get("VmRSS", 0))
    return _own_pss_mib(pid) + freed_since_peak / 1024


class PeakPss:
    """`with PeakPss({"worker": pid, ...}) as peaks: ...` then `peaks.mib` holds each name's
    peak PSS over the block (a process gone by its end has no figure)."""

    def __init__(self, pids: dict[str, int]):
        self.pids = pids
        self.mib: dict[str, float] = {}

    def __enter__(self) -> PeakPss:
        for pid in self.pids.values():
            for member in _tree(pid):
                _reset_peak(member)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for name, pid in self.pids.items():
            if (peak := _tree_sum(pid, _peak_pss_since_reset_mib)) is not None:
                self.mib[name] = peak
