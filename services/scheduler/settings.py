"""The scheduler's settings, shared by the mesh's scheduler (SchedulerServiceSettings) and the
in-process engine (EngineConfig): each default, flag, VMESH_* variable and help text written once
here (services/common/config_flags.py derives the command line from them)."""

from __future__ import annotations

from dataclasses import dataclass

from vmesh.services.common.config_flags import setting
from vmesh.services.common.runtime.discovery import DetokenizerReplicaSettings, expand_addresses

SCHEDULING_POLICIES = ("fcfs", "priority")
PIPELINE_DEPTHS = (1, 2)  # step plans in flight: 1 synchronous, 2 async scheduling


@dataclass
class SchedulerSettings:
    max_num_batched_tokens: int = setting(2048, section="scheduler")
    pipeline_depth: int = setting(2, section="scheduler", choices=PIPELINE_DEPTHS,
                                  help="1: synchronous steps (V0); 2: plan step N+1 while step N computes")
    policy: str = setting(  # "priority": (priority, arrival) order, lowest value first
        "fcfs", section="scheduler", flag="--scheduling-policy", choices=SCHEDULING_POLICIES)
    enable_prefix_caching: bool = setting(True, section="scheduler", flag="--no-prefix-caching", negated=True)
    stateless_worker: bool = setting(
        False, section="scheduler", help="resend every scheduled request in full each step (V0), for measurement")
    max_waiting: int | None = setting(  # None: unbounded
        4096, section="scheduler", help="waiting-queue size; beyond it: RESOURCE_EXHAUSTED")
    worker_recovery_timeout_s: float = setting(
        60.0, section="scheduler", flag="--worker-recovery-timeout",
        help="seconds a lost worker has to come back (restarted in place) before its requests fail with "
             "UNAVAILABLE; until then they wait and are recomputed on its replacement (mesh only)")


@dataclass(kw_only=True)
class SchedulerServiceSettings(SchedulerSettings, DetokenizerReplicaSettings):
    """One scheduler process's settings: the scheduler's own and where its peers are. (The peers'
    flags are the scheduler subcommand's own: `vmesh serve` sets them per group instead of
    forwarding them.)"""
    # Its worker group's ranks, rank 0 first: resolved once, for the group is fixed.
    worker_addresses: list[str] = setting([], section="worker ranks", flag="--workers", to_field=expand_addresses,
                                          help="worker rank addresses, comma-separated")
