"""The rows whose request asked for something computed over its prompt (its prompt logprobs, its
pooled embedding) and delivered with its first token: kept from the plan that brings them until
that token, and forgotten when they leave the batch. One tracker per kind, sharing these rules."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from vmesh.services.common.step_types import NewRequest, StepPlan
from vmesh.services.worker.persistent_batch import PersistentBatch

Pending = TypeVar("Pending")


class PromptRows(Generic[Pending]):
    def __init__(self) -> None:
        self.pending: dict[int, Pending] = {}  # by handle: rows that asked and have not sampled yet

    def __bool__(self) -> bool:
        return bool(self.pending)

    def clear(self) -> None:
        self.pending.clear()

    def follow_asking(self, plan: StepPlan, batch: PersistentBatch,
                      start: Callable[[NewRequest], Pending | None]) -> None:
        """Track the plan's new rows that `start` gives a pending entry (None: it does not ask) and
        forget rows that left the batch (after batch.apply). A request with outputs already had its
        answer with its first token. A row added at position 0 starts over; one added further on
        (after a prefix-cache hit, or the stateless worker's rebuild, every step) keeps what it has."""
        for request in plan.new_requests:
            if len(request.token_ids) > request.num_prompt_tokens:
                continue
            pending = start(request)
            if pending is not None and (request.num_computed_tokens == 0 or request.handle not in self.pending):
                self.pending[request.handle] = pending
        if self.pending:
            self.pending = {h: p for h, p in self.pending.items() if h in batch}

    def asking(self, plan: StepPlan) -> list[tuple[int, int]]:
        """(index in the plan, handle) of this step's scheduled rows that ask."""
        return [(i, h) for i, h in enumerate(plan.scheduled_handles) if h in self.pending]
