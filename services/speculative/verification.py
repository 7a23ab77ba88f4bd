"""Verifying drafts against the target model's own samples.

A row with d drafts computes 1 + d positions in one forward; the sampler draws a token at each
position exactly as non-speculative decoding would there (same penalties, bans, seed and
position), and the row keeps its sampled tokens up to and including the first that differs from
the draft at its position. For a deterministic draft x this is the speculative-sampling rule:
the sample y at a position is distributed as p, so x is accepted with probability p(x), and on a
rejection y is a draw from p given y != x, which is p with x removed and renormalised. Greedy
rows accept exactly the drafts argmax agrees with; a seeded row's tokens equal those it would
sample without speculation, since each position's draw depends only on (seed, position) and
the logits there.
"""

from __future__ import annotations

import torch


def num_accepted(samples: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """[R] int64: leading drafts equal to the sample at their position. `samples`: [R, k + 1],
    row r's samples in its first num_drafts[r] + 1 columns; `drafts`: [R, k]."""
    k = drafts.shape[1]
    agree = (samples[:, :k] == drafts) & (torch.arange(k)[None, :] < num_drafts[:, None])
    return agree.long().cumprod(dim=1).sum(dim=1)
