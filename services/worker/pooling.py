"""Embedding requests' pooling: one vector per request from its prompt's final hidden states
(after the final norm, what the LM head reads), for the rows whose request asks
(SamplingParams.pooling), delivered with the request's first token.

LAST takes the last prompt position, MEAN the mean over every prompt position, CLS the first.
Only the asking rows add positions to the step's hidden-state gather: LAST and CLS one position
(in the chunk that holds it), MEAN every prompt position of each chunk, summed chunk by chunk.
The others compute logits at their sampling positions alone, as before.

Correct across chunked prefill (each chunk adds its own positions), preemption (a row removed
before its first token loses its sum and, readmitted from position 0, computes it again: the
same values) and failover (a request resumed with outputs received its vector with its first
token, so it asks for none again). MEAN and CLS never read the prefix cache
(Pooling.reads_prefix_cache, services/scheduler/request.py): a cached block keeps no hidden
states. LAST may: the scheduler always computes the last prompt position (its logits sample).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vmesh.services.common.step_types import StepPlan
from vmesh.services.common.types import Pooling, PoolingType
from vmesh.services.worker.persistent_batch import PersistentBatch, StepInputs
from vmesh.services.worker.prompt_rows import PromptRows


@dataclass
class _Pending:
    pooling: Pooling
    total: torch.Tensor | None = None  # [hidden] float32: the pooled positions' sum so far
    count: int = 0  # positions in `total`


@dataclass
class PooledPositions:
    """This step's positions whose hidden states an asking row pools, in the asking rows' plan order."""
    indices: torch.Tensor  # [total] the positions' indices in the step's flattened inputs
    handles: list[int]  # the asking rows' handles
    counts: list[int]  # positions pooled per asking row (0 for a chunk that holds none it pools)


class Pooler(PromptRows[_Pending]):
    def follow(self, plan: StepPlan, batch: PersistentBatch) -> None:
        self.follow_asking(plan, batch, lambda r: None if r.sampling.pooling is None else _Pending(r.sampling.pooling))

    def positions(self, plan: StepPlan, inputs: StepInputs, batch: PersistentBatch) -> PooledPositions | None:
        """The positions to pool this step (before finish_step advances the computed counts), or
        None when no scheduled row asks."""
        asking = self.asking(plan)
        if not asking:
            return None
        index = torch.tensor([i for i, _ in asking], dtype=torch.int64)
        types = [self.pending[h].pooling.type for _, h in asking]
        rows = inputs.rows[index]
        per_request = inputs.num_scheduled + inputs.num_drafts
        query_start = (torch.cumsum(per_request, 0) - per_request)[index]
        start = batch.num_computed_tokens[rows]
        prompt_end = batch.num_prompt_tokens[rows]
        end = torch.minimum(start + inputs.num_scheduled[index], prompt_end)
        # Each row's pooled span within [start, end): all of it (MEAN), the last prompt position, or the first.
        last = torch.tensor([t is PoolingType.LAST for t in types])
        first = torch.tensor([t is PoolingType.CLS for t in types])
        low = torch.where(last, torch.maximum(start, prompt_end - 1), start)
        high = torch.where(first, torch.minimum(end, torch.ones_like(end)), end)
        counts = (high - low).clamp(min=0)
        total = int(counts.sum())
        owner = torch.repeat_interleave(torch.arange(len(asking)), counts, output_size=total)
        offset = torch.arange(total) - (torch.cumsum(counts, 0) - counts)[owner]
        return PooledPositions(indices=query_start[owner] + (low - start)[owner] + offset,
                               handles=[h for _, h in asking], counts=counts.tolist())

    def record(self, pooled: PooledPositions, hidden: torch.Tensor) -> None:
        """Add the positions' final hidden states ([total, hidden], in `pooled`'s order) to their rows' sums."""
        if not len(pooled.indices):
            return
        owner = torch.repeat_interleave(torch.arange(len(pooled.handles), device=hidden.device),
                                        torch.tensor(pooled.counts, device=hidden.device), output_size=len(hidden))
        sums = torch.zeros(len(pooled.handles), hidden.shape[1], dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, owner, hidden.float())
        for handle, row_sum, count in zip(pooled.handles, sums.cpu(), pooled.counts):
            if count:
                pending = self.pending[handle]
                pending.total = row_sum if pending.total is None else pending.total + row_sum
                pending.count += count

    def take(self, sampled_handles: list[int]) -> dict[int, list[float]]:
        """The vector of every asking request that sampled its first token this step (and forgets them)."""
        taken: dict[int, list[float]] = {}
        for handle in sampled_handles:
            pending = self.pending.pop(handle, None)
            if pending is None or pending.total is None:
                continue
            vector = pending.total / pending.count if pending.pooling.type is PoolingType.MEAN else pending.total
            if pending.pooling.normalize:
                vector = torch.nn.functional.normalize(vector, dim=0)
            taken[handle] = vector.tolist()
        return taken
