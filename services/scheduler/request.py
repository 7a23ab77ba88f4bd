"""A request as the scheduler tracks it."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum

from vmesh.services.common.types import FinishReason, SamplingParams
from vmesh.services.scheduler.kv_cache_manager import BlockTables


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_arrivals = itertools.count()


@dataclass(eq=False)  # identity: requests are found in queues by object
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int = 0
    arrival_order: int = field(default_factory=lambda: next(_arrivals))
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Output tokens scheduled whose sampled ids have not come back yet (async scheduling).
    num_placeholders: int = 0
    # Draft slots reserved by each step in flight that samples this request, oldest first: that
    # step's placeholders are 1 + slots until its result says how many drafts were kept.
    draft_slots_in_flight: deque[int] = field(default_factory=deque)
    # Recent share of this request's drafts that were accepted (services/scheduler/speculation.py).
    draft_acceptance: float = 1.0
    decodes_without_drafts: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    handle: int | None = None
    on_worker: bool = False  # the worker holds a row for this request
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0
    # Its block table in each KV cache group (services/scheduler/kv_cache_manager.py).
    tables: BlockTables = field(default_factory=lambda: BlockTables([[]]))
    block_hashes: list[int] = field(default_factory=list)  # of full blocks, chained
    num_registered_blocks: int = 0  # leading blocks entered in the prefix cache
    lora_name: str = ""  # the LoRA adapter it runs with; "": the base model
    # Its client's handle for resuming the stream elsewhere, and its prompt's digest
    # (services/common/resume.py); the core only carries them. "": not resumable.
    resume_key: str = ""
    prompt_digest: bytes = b""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        return self.num_tokens + self.num_placeholders

    @property
    def block_ids(self) -> list[int]:
        """Every KV block the request holds, in every group."""
        return self.tables.held()

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def reusable_block_hashes(self) -> list[int]:
        """The hashes the prefix cache may serve: none for a request asking prompt logprobs, which
        computes every position because a cached block keeps no logits, nor for an embedding
        request pooling more than its last position (a cached block keeps no hidden states)."""
        pooling = self.sampling.pooling
        if self.sampling.prompt_logprobs is not None or (pooling is not None and not pooling.reads_prefix_cache):
            return []
        return self.block_hashes

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


def adapter_fits(running: Iterable[Request], request: Request, max_loras: int) -> bool:
    """Whether `request` may join `running` with the worker's --max-loras: a step uses every
    running request's adapter, and the worker holds at most that many at once."""
    if not request.lora_name:
        return True
    adapters = {r.lora_name for r in running if r.lora_name}
    return request.lora_name in adapters or len(adapters) < max_loras
