"""The command line's settings groups, and which of `vmesh serve`'s flags reach which service.

Every settings argument group (model, worker, scheduler, frontend; and the per-process server,
security and peer-address groups) is made of one settings dataclass's fields
(services/common/config_flags.py). `vmesh serve` gives a service every flag
of each group it owns, so a setting added to a dataclass can never be left behind. Two kinds of
setting travel otherwise: the per-rank ones (PER_WORKER_PROCESS), which are not flags of `vmesh
serve` at all, since the launcher sets them for each worker process itself; and secrets, which
go in the service's environment, since `ps` shows everyone its argv."""

from __future__ import annotations

import argparse

from vmesh.services.common.config_flags import env_name, forwarded_argv, section_flags
from vmesh.services.common.runtime.discovery import DetokenizerReplicaSettings
from vmesh.services.common.server_settings import ServerSettings
from vmesh.services.frontend.settings import FrontendSettings
from vmesh.services.scheduler.settings import SchedulerServiceSettings, SchedulerSettings
from vmesh.services.worker.config import PER_WORKER_PROCESS, WorkerConfig

SETTINGS_GROUPS: dict[str, type] = {"model": WorkerConfig, "worker": WorkerConfig, "scheduler": SchedulerSettings,
                                    "frontend": FrontendSettings,
                                    # Each process's own, set by the launcher per child rather than forwarded:
                                    "server": ServerSettings, "security": ServerSettings,
                                    "detokenizer replicas": DetokenizerReplicaSettings,
                                    "worker ranks": SchedulerServiceSettings}
SECRET_SETTINGS = ("api_key",)  # as VMESH_<FLAG>


def group_flags(group: str) -> list[tuple[str, str]]:
    """(--flag, dest) of each option in `vmesh serve`'s argument group titled `group`."""
    flags = section_flags(SETTINGS_GROUPS[group], group)
    return [(flag, dest) for flag, dest in flags if dest not in PER_WORKER_PROCESS]


def forwarded_flags(args: argparse.Namespace, group: str) -> list[str]:
    """The command-line form of the flags of `group` that `vmesh serve` took: what a service
    that owns the group is given (its secrets aside)."""
    return forwarded_argv(SETTINGS_GROUPS[group], group, args, skip={*PER_WORKER_PROCESS, *SECRET_SETTINGS})


def forwarded_secrets(args: argparse.Namespace, group: str) -> dict[str, str]:
    """The secrets of `group` that `vmesh serve` took, as the environment that sets them."""
    return {env_name(flag): str(getattr(args, dest)) for flag, dest in group_flags(group)
            if dest in SECRET_SETTINGS and getattr(args, dest)}
