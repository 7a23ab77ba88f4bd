"""The scheduler's settings, shared by the mesh's scheduler (SchedulerServiceSettings) and the
in-process engine (EngineConfig): each default, flag, VMESH_* variable and help text written once
here (services/common/config_flags.py derives the command line from them)."""

from __future__ import annotations

from dataclasses import dataclass

from vmesh.services.common.config_flags import setting
from vmesh.services.common.runtime.discovery import DetokenizerReplicaSettings, expand_addresses

SCHEDULING_POLICIES = ("fcfs", "priority")
PIPELINE_DEPTHS = (1, 2)  # step plans in flight: 1 synchronous, 2 async scheduling
# Decode first: a step that carries running decodes carries at most this many prefill tokens, so
# that a long prompt (or a burst of them) delays each running stream by a bounded amount per step
# instead of by a whole max_num_batched_tokens of prefill. The bound a decode step pays is this
# cap times the per-token prefill cost: on the 2-core CPU of benchmarks/README.md ("Decode first")
# ~0.3 ms a token in bfloat16 (a cost model fitted to a recorded burst) and up to ~1.1 in float32
# (the linears' FLOPs), i.e. ~80-280 ms over the decode itself, where a whole 2,048-token budget
# of prefill is 0.6-2.3 s. 256 lets a 256-token prompt enter in one step; steps with no decodes
# (an idle mesh's first prompts) take the whole max_num_batched_tokens.
DEFAULT_MAX_PREFILL_TOKENS_WITH_DECODES = 256


@dataclass
class SchedulerSettings:
    max_num_batched_tokens: int = setting(2048, section="scheduler")
    max_prefill_tokens_with_decodes: int = setting(
        DEFAULT_MAX_PREFILL_TOKENS_WITH_DECODES, section="scheduler",
        help="prefill tokens a step may carry beside running decodes, so that a long prompt never stalls them "
             "for more than this many tokens' compute per step (0: no cap, prefill fills max-num-batched-tokens)")
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


@dataclass(frozen=True)
class WorkerGeometry:
    """What the scheduler must know of the worker it plans for (the mesh's worker reports it in
    GetWorkerInfo; the in-process engine reads it off its model runner)."""
    max_model_len: int
    max_num_seqs: int  # rows of the worker's persistent batch
    num_kv_blocks: int
    block_size: int
    eos_token_ids: tuple[int, ...] = ()
    num_speculative_tokens: int = 0  # the worker proposes drafts (0: it does not)
    speculative_disable_by_batch_size: int = 0
    max_loras: int = 0  # LoRA adapters one step may use (0: the worker serves none)
    # Each KV cache group's sliding window (None: global attention), in the worker's group order
    # (services/common/kv_cache_groups.py): a plan carries one block table per group.
    kv_cache_windows: tuple[int | None, ...] = (None,)


@dataclass
class SchedulerConfig:
    """What one scheduler runs under: its service's SchedulerSettings resolved against the worker
    it drives (`for_worker`)."""
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    policy: str  # "fcfs", or "priority": (priority, arrival) order, lowest value first
    max_waiting: int | None  # None: unbounded waiting queue
    max_prefill_tokens_with_decodes: int = 0  # 0: prefill may fill the step's budget beside decodes
    max_loras: int = 0  # distinct LoRA adapters among running requests, at most (request.adapter_fits)

    def __post_init__(self) -> None:
        # The command line offers only these (argparse choices), but a library caller's
        # EngineConfig is checked nowhere else, and an unknown policy would quietly act as fcfs.
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"unknown scheduling policy {self.policy!r} ({' or '.join(SCHEDULING_POLICIES)})")
        if self.max_prefill_tokens_with_decodes < 0:
            raise ValueError(f"max_prefill_tokens_with_decodes must be 0 (no cap) or positive, got "
                             f"{self.max_prefill_tokens_with_decodes}")

    @classmethod
    def for_worker(cls, settings: SchedulerSettings, worker: WorkerGeometry) -> SchedulerConfig:
        return cls(max_model_len=worker.max_model_len, max_num_seqs=worker.max_num_seqs,
                   max_num_batched_tokens=settings.max_num_batched_tokens, policy=settings.policy,
                   max_waiting=settings.max_waiting,
                   max_prefill_tokens_with_decodes=settings.max_prefill_tokens_with_decodes, max_loras=worker.max_loras)
