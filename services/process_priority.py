"""How the mesh's other services yield the cores to its worker. On a small CPU every core runs
one of the worker's OpenMP threads during a forward; a service that preempts one of them stalls
the whole parallel region until that thread runs again. `vmesh serve --service-niceness N` starts
the frontend, schedulers and detokenizers at a lower priority (a higher niceness) than the workers,
so that the kernel runs them on a core the worker leaves idle rather than in the middle of its
forward."""

from __future__ import annotations

import logging
import os

# 0 (all equal) until a quiet sitting shows a gain (benchmarks/README.md, "The services' priority"):
# on a shared host a niced service loses the cores to every other process, not only to the worker.
DEFAULT_SERVICE_NICENESS = 0
NICENESS_ENV = "VMESH_LAUNCHER_NICENESS"  # the launcher's word to a service it starts
UNNICED_SERVICES = ("worker",)

logger = logging.getLogger(__name__)


def niceness_env(service: str, niceness: int) -> dict[str, str]:
    """The environment that tells a service the launcher starts to lower its priority by `niceness`."""
    if service in UNNICED_SERVICES or niceness == 0:
        return {}
    return {NICENESS_ENV: str(niceness)}


def take_launcher_priority() -> None:
    """In a service started by `vmesh serve`: lower this process's priority as the launcher asks,
    before any thread starts (each thread inherits its creator's niceness on Linux)."""
    niceness = os.environ.pop(NICENESS_ENV, None)
    if niceness is None or not hasattr(os, "nice"):
        return
    try:
        os.nice(int(niceness))
    except OSError as exc:  # e.g. a seccomp profile that forbids it: run at the inherited priority
        logger.warning("could not lower this service's priority by %s: %s", niceness, exc)
