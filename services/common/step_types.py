"""What the scheduler sends a worker each step, and what comes back.

A plan is a diff against the worker's persistent batch (docs/architecture.md, "The step
protocol"): new requests arrive in full once; running requests are columns indexed by a
compact integer handle. A plan never carries sampled tokens: the worker appends its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vmesh.services.common.step_timeline import WorkerStepTiming
from vmesh.services.common.types import SamplingParams, TokenLogprobs


@dataclass
class NewRequest:
    handle: int
    # Every token known so far: the prompt, plus earlier outputs when a preempted request resumes.
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int = 0  # tokens already in the KV cache (prefix-cache hits)
    lora_name: str = ""  # the LoRA adapter the request runs with; "": the base model


@dataclass
class StepPlan:
    step: int
    new_requests: list[NewRequest] = field(default_factory=list)
    # Handles leaving the batch (finished, aborted or preempted), applied before anything else.
    removed_handles: list[int] = field(default_factory=list)
    # The step's batch in compute order; new requests are listed here too.
    scheduled_handles: list[int] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    # Blocks appended to each scheduled request's table: flattened, with one count per request.
    new_block_ids: list[int] = field(default_factory=list)
    num_new_blocks: list[int] = field(default_factory=list)
    # Per scheduled handle, or empty when no row has any: KV slots reserved after the row's next
    # token for the drafts the worker may propose and verify in this step (services/speculative/).
    num_draft_slots: list[int] = field(default_factory=list)

    @property
    def total_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)


@dataclass
class StepResult:
    step: int
    # One entry per request that produced a token (a prefill chunk that does not reach the end
    # of the prompt produces none), in plan order.
    handles: list[int]
    sampled_token_ids: list[int]  # flattened: num_sampled_tokens[i] of them for handles[i]
    # Per handle, or empty when every handle kept one token: 1 + the drafts it accepted.
    num_sampled_tokens: list[int] = field(default_factory=list)
    # Per handle, or empty when no handle had drafts: how many the worker proposed and verified.
    num_draft_tokens: list[int] = field(default_factory=list)
    # Present only for requests that asked for logprobs: one row per token, owned by the handle
    # at the same index of logprobs_handles.
    logprobs_handles: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Requests that asked for prompt logprobs and sampled their first token this step: one row
    # per prompt token from the second on (the first has no context to be scored in).
    prompt_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    # Embedding requests (sampling.pooling) that sampled their first token this step: the pooled vector.
    embeddings: dict[int, list[float]] = field(default_factory=dict)
    forward_seconds: float = 0.0
    sampling_seconds: float = 0.0
    # Requests this step failed on their own (their grammar matcher failed: it would not load,
    # or rejected a token), each with its message; their tokens are not among the sampled ones.
    failed_handles: list[int] = field(default_factory=list)
    failure_messages: list[str] = field(default_factory=list)
    timing: WorkerStepTiming | None = None  # the worker's account of the step (services/common/step_timeline.py)
