"""Prompt logprobs: each prompt token's logprob (from the second on), its rank and the top N at
its position, for the rows whose request asks (SamplingParams.prompt_logprobs).

The logits at position p score the token at p + 1, so a prefill chunk computing positions
[c, c + n) scores prompt tokens c + 1 .. min(c + n, P) - 1 (P: the prompt's length; the last
prompt position's logits are the sampling row every request has). Only the asking rows add
positions to the step's logits; the others still compute logits at their sampling positions
alone. A row keeps its chunks' rows here until it samples its first token, and they travel with
that token, so downstream every request gets its prompt logprobs in one piece.

Correct across chunked prefill (each chunk scores its own positions), preemption (a row
removed before its first token loses its chunks and, readmitted from position 0, computes them
again: the same values) and failover (a request resumed with outputs delivered its prompt
logprobs with its first token, so it asks for none again). A request that asks never reads
the prefix cache (services/scheduler/request.py, `reusable_block_hashes`): every position is
computed, so every position is scored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vmesh.services.common.step_types import StepPlan
from vmesh.services.common.types import TokenLogprobs
from vmesh.services.worker.persistent_batch import PersistentBatch, StepInputs
from vmesh.services.worker.prompt_rows import PromptRows


@dataclass
class _Chunk:
    logprobs: torch.Tensor  # [n] float32: each scored prompt token's logprob
    ranks: torch.Tensor  # [n] int64
    top_ids: torch.Tensor  # [n, num_top]
    top_logprobs: torch.Tensor  # [n, num_top]


@dataclass
class _Pending:
    num_top: int
    chunks: list[_Chunk] = field(default_factory=list)


@dataclass
class ScoredPositions:
    """This step's positions whose logits score a prompt token, for the asking rows in plan order."""
    indices: torch.Tensor  # [total] the positions' indices in the step's flattened inputs
    targets: torch.Tensor  # [total] the prompt token each position scores
    handles: list[int]  # the asking rows' handles
    counts: list[int]  # positions scored per asking row (0 for a chunk of its last position only)


class PromptLogprobs(PromptRows[_Pending]):
    def follow(self, plan: StepPlan, batch: PersistentBatch) -> None:
        self.follow_asking(plan, batch, lambda r: None if r.sampling.prompt_logprobs is None
                           else _Pending(r.sampling.prompt_logprobs))

    def positions(self, plan: StepPlan, inputs: StepInputs, batch: PersistentBatch) -> ScoredPositions | None:
        """The positions to score this step (before finish_step advances the computed counts), or
        None when no scheduled row asks."""
        asking = self.asking(plan)
        if not asking:
            return None
        index = torch.tensor([i for i, _ in asking], dtype=torch.int64)
        rows = inputs.rows[index]
        per_request = inputs.num_scheduled + inputs.num_drafts
        query_start = (torch.cumsum(per_request, 0) - per_request)[index]
        start = batch.num_computed_tokens[rows]
        end = torch.minimum(start + inputs.num_scheduled[index], batch.num_prompt_tokens[rows] - 1)
        counts = (end - start).clamp(min=0)
        total = int(counts.sum())
        owner = torch.repeat_interleave(torch.arange(len(asking)), counts, output_size=total)
        offset = torch.arange(total) - (torch.cumsum(counts, 0) - counts)[owner]
        positions = start[owner] + offset
        return ScoredPositions(indices=query_start[owner] + offset,
                               targets=batch.token_ids[rows[owner], positions + 1],
                               handles=[h for _, h in asking], counts=counts.tolist())

    def record(self, scored: ScoredPositions, logits: torch.Tensor) -> None:
        """Score the positions from their logits ([total, vocab], in `scored`'s order)."""
        if not len(scored.targets):
            return
        logprobs = logits.float().log_softmax(dim=-1)
        targets = scored.targets.to(logprobs.device)
        target_logprobs = logprobs.gather(1, targets[:, None]).squeeze(1)
        ranks = (logprobs > target_logprobs[:, None]).sum(dim=-1) + 1
        max_top = max(self.pending[h].num_top for h in scored.handles)
        top = logprobs.topk(max_top, dim=-1) if max_top else None
        top_ids = top.indices if top else targets[:, None][:, :0]
        top_logprobs = top.values if top else logprobs[:, :0]
        columns = [t.cpu().split(scored.counts) for t in (target_logprobs, ranks, top_ids, top_logprobs)]
        for handle, *chunk in zip(scored.handles, *columns):
            pending = self.pending[handle]
            pending.chunks.append(_Chunk(chunk[0], chunk[1], chunk[2][:, :pending.num_top],
                                         chunk[3][:, :pending.num_top]))

    def take(self, sampled_handles: list[int]) -> dict[int, list[TokenLogprobs]]:
        """The rows of every asking request that sampled its first token this step (and forgets them)."""
        taken: dict[int, list[TokenLogprobs]] = {}
        for handle in sampled_handles:
            pending = self.pending.pop(handle, None)
            if pending is None:
                continue
            chunks = pending.chunks
            logprobs = torch.cat([c.logprobs for c in chunks]).tolist() if chunks else []
            ranks = torch.cat([c.ranks for c in chunks]).tolist() if chunks else []
            top_ids = torch.cat([c.top_ids for c in chunks]).tolist() if chunks else []
            top_logprobs = torch.cat([c.top_logprobs for c in chunks]).tolist() if chunks else []
            taken[handle] = [TokenLogprobs(lp, rank, ids, lps)
                             for lp, rank, ids, lps in zip(logprobs, ranks, top_ids, top_logprobs)]
        return taken
