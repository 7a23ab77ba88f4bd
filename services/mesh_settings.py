"""`vmesh serve`'s own settings: how many of each service it starts, and how it runs them. The
launcher reads them (services/launcher.py); no service is given them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from vmesh.services.common.config_flags import setting, values_from_args
from vmesh.services.process_priority import DEFAULT_SERVICE_NICENESS


@dataclass(frozen=True)
class MeshSettings:
    detokenizers: int = setting(1, section="mesh", help="detokenizer replicas")
    data_parallel_size: int = setting(
        1, section="mesh",
        help="worker groups, each a worker and its scheduler; the frontend spreads requests over them")
    frontends: int = setting(
        1, section="mesh",
        help="frontends, each with its own gRPC and HTTP port (the first on --port and --http-port, the others on "
             "free ports): a client whose frontend dies resumes its stream through another")
    metrics: bool = setting(False, section="mesh", help="every service serves Prometheus metrics on a free port")
    fail_fast: bool = setting(
        False, section="mesh",
        help="stop the whole mesh when any service dies (default: restart it in place, with backoff; its requests "
             "fail over)")
    service_niceness: int = setting(
        DEFAULT_SERVICE_NICENESS, section="mesh",
        help="niceness the frontend, schedulers and detokenizers start at, above the workers', so that they do "
             "not preempt the workers' threads mid-forward on a small CPU (0: all at the launcher's priority)")
    # On by default: a local process that is not part of the mesh must not reach its internal ports.
    internal_tls: bool = setting(
        True, section="mesh", flag="--no-internal-tls", negated=True,
        help="plaintext between the services (default: mutual TLS from a private CA made for this run, whose "
             "admin certificate the launcher prints and describes beside --ready-file, for operator tools)")


def mesh_settings(args: argparse.Namespace) -> MeshSettings:
    """The settings `vmesh serve` was given (a flag it lacks keeps its default)."""
    return MeshSettings(**values_from_args(MeshSettings, args, "mesh"))
