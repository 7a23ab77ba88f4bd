"""Vectorised sampling over a batch of logits rows.

Order: the grammar's token mask (rows with structured output) on the raw logits; penalties;
min-tokens bans; greedy rows take the argmax; other rows are divided
by their temperature, restricted by top-k, top-p and min-p, and drawn by inverse transform:
one float64 uniform U per row, and the first token whose cumulative weight (float64) exceeds
U times the row's total (found through per-block sums, so only one block of a row is
cumulated). One uniform a row, where a race (argmax of p / q, q ~ Exp(1)) needs
one per token: drawing 64 x 49,152 float64 uniforms was most of a sampled step on the CPU.
A seeded row draws its U from its own generator, reseeded from (seed, position), so its token
depends only on its own logits, never on its batch neighbours, on preemption or on how
many steps it waited. Logprobs always come from the raw logits, before the grammar's mask.
A masked token is never drawn: its logit is -inf before top-k, top-p and min-p, so its weight
is 0 and its interval of the cumulative sum empty.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vmesh.kernels.cpu_native import CpuKernels
from vmesh.services.common.structured import apply_token_bitmask
from vmesh.services.common.types import GREEDY_TEMPERATURE_EPS

_MASKED = float("-inf")
# SamplingParams.logprobs None in an integer column: the row asks for no logprobs.
NO_LOGPROBS = -1
_SEED_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: distinct positions give distinct seeds


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64, as SamplingParams.top_k: <= 0 disables
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    repetition_penalty: torch.Tensor  # [B]
    presence_penalty: torch.Tensor  # [B]
    frequency_penalty: torch.Tensor  # [B]
    num_logprobs: torch.Tensor  # [B] int64, NO_LOGPROBS for SamplingParams.logprobs None
    generators: list[torch.Generator | None]  # per row; None = the global generator
    seeds: list[int | None]
    positions: list[int]  # index of the token being sampled, for reseeding
    # Only when some row has penalties: prompt+output token ids padded with -1, and the
    # output tokens alone (the part presence/frequency penalties count).
    seen_token_ids: torch.Tensor | None = None
    output_token_ids: torch.Tensor | None = None
    # (rows, token ids) that may not be sampled yet: EOS and stop ids before min_tokens.
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    # Only when some row has a grammar: the packed allowed-token bitmask (int32 [B, ceil(vocab / 32)],
    # CPU), applied to the rows listed in bitmask_rows (None: every row).
    token_bitmask: torch.Tensor | None = None
    bitmask_rows: list[int] | None = None


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    # For rows with num_logprobs >= 0 (in row order): sampled logprob, rank and top-N.
    logprob_rows: torch.Tensor | None = None
    sampled_logprobs: torch.Tensor | None = None
    sampled_ranks: torch.Tensor | None = None
    top_token_ids: torch.Tensor | None = None  # [R, max_n]
    top_logprobs: torch.Tensor | None = None


def argmax_rows(scores: torch.Tensor) -> torch.Tensor:
    """[B] int64: each row's first maximal index (a NaN counts as maximal), as
    torch.argmax(dim=-1). numpy computes it for CPU float32 rows: torch's CPU argmax does not
    vectorise (benchmarks/README.md, "The worker's per-step bookkeeping": 10-20x slower here)."""
    if scores.device.type == "cpu" and scores.dtype == torch.float32:
        return torch.from_numpy(scores.detach().numpy().argmax(axis=-1))
    return scores.argmax(dim=-1)


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition penalty over prompt and output tokens (divide positive logits, multiply
    negative ones); presence and frequency penalties over output tokens only."""
    vocab = logits.shape[-1]
    logits = logits.clone()
    if batch.seen_token_ids is not None:
        seen = _token_counts(batch.seen_token_ids, vocab) > 0
        penalty = batch.repetition_penalty.unsqueeze(1).to(logits.dtype)
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    if batch.output_token_ids is not None:
        counts = _token_counts(batch.output_token_ids, vocab).to(logits.dtype)
        logits -= batch.frequency_penalty.unsqueeze(1) * counts
        logits -= batch.presence_penalty.unsqueeze(1) * (counts > 0).to(logits.dtype)
    return logits


def _token_counts(token_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    counts = torch.zeros((token_ids.shape[0], vocab + 1), dtype=torch.int64, device=token_ids.device)
    # -1 padding lands in the extra last column, which is dropped.
    counts.scatter_add_(1, token_ids.masked_fill(token_ids < 0, vocab), torch.ones_like(token_ids))
    return counts[:, :vocab]


# How many of a row's largest logits top-k and top-p read first. Sorting whole rows was most of a
# sampled step on the CPU (64 rows of 49,152: 129 ms; their 1,024 largest: 17 ms); a row whose
# top-k or nucleus reaches past them is sorted whole.
CANDIDATES = 1024


def restrict_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) every token outside each row's top-k, top-p nucleus and min-p floor.
    Ties at a threshold are kept."""
    vocab = logits.shape[-1]
    use_top_k = bool((top_k > 0).any())
    use_top_p = bool((top_p < 1.0).any())
    if use_top_k or use_top_p:
        width = min(vocab, CANDIDATES)
        if not use_top_p:  # top-k alone reads no further than the batch's largest k
            width = min(width, int(top_k.max()))
        threshold, decided = _keep_thresholds(logits, top_k, top_p, use_top_k, use_top_p, width)
        if not bool(decided.all()):
            rows = torch.nonzero(~decided).squeeze(1)
            threshold[rows] = _keep_thresholds(logits[rows], top_k[rows], top_p[rows], use_top_k, use_top_p, vocab)[0]
        logits = logits.masked_fill(logits < threshold, _MASKED)
    if bool((min_p > 0).any()):
        probs = logits.softmax(dim=-1)
        floor = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < floor, _MASKED)
    return logits


def _keep_thresholds(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, use_top_k: bool,
                     use_top_p: bool, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, 1] the smallest logit each row keeps under its top-k and top-p (-inf: all), [B] whether
    its `width` largest logits decided that): a k past them, or a nucleus that still takes in the
    last of them, is undecided. Probabilities are over the whole row (after top-k)."""
    vocab = logits.shape[-1]
    ranked = (logits.topk(width, dim=-1) if width < vocab else logits.sort(dim=-1, descending=True)).values
    masked = torch.tensor(_MASKED, dtype=logits.dtype)
    # Neither limit may drop the maximum, so the threshold starts below everything.
    threshold = torch.full_like(ranked[:, :1], _MASKED)
    decided = torch.ones(len(logits), dtype=torch.bool, device=logits.device)
    kth = None
    if use_top_k:
        limited = (top_k > 0) & (top_k < vocab)  # a k of the whole vocabulary keeps everything
        k = torch.where(limited, top_k, 1).clamp(max=width)
        decided = ~limited | (top_k <= width)
        kth = torch.where(limited.unsqueeze(1), ranked.gather(1, (k - 1).unsqueeze(1)), masked)
        ranked = ranked.masked_fill(ranked < kth, _MASKED)
        threshold = kth
    if use_top_p:
        if width < vocab:
            row = logits if kth is None else logits.masked_fill(logits < kth, _MASKED)
            top = ranked[:, :1]
            probs = (ranked - top).exp() / (row - top).exp().sum(dim=-1, keepdim=True)
        else:
            probs = ranked.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        whole = (top_p >= 1.0).unsqueeze(1)  # keeps everything, whatever the cumulative sum's rounding
        inside = (mass_before < top_p.unsqueeze(1)) | whole
        count = inside.sum(dim=-1, keepdim=True)
        decided &= (count < width).squeeze(1) | whole.squeeze(1) | (width == vocab)
        # The smallest logit still inside the nucleus is the row's threshold.
        edge = torch.where(whole, masked, ranked.gather(1, count.clamp(min=1) - 1))
        threshold = torch.maximum(threshold, edge)
    return threshold, decided


# The draw sums a row's weights per block of this many tokens, then cumulates only the block the
# uniform falls in: a float64 cumulative sum of whole rows (64 x 49,152) was half of the draw.
DRAW_BLOCK = 1024
_BELOW_ONE = 1.0 - 2.0 ** -53  # float64's largest value below 1, the largest torch.rand draws


def inverse_transform(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """[B, 1] per row the token whose interval of the cumulative weight holds U times the row's
    total, for U in [0, 1): the first token whose running sum (float64) exceeds it; the vocabulary
    size where no token does (a non-monotone running sum: the caller then keeps the argmax).

    A long row goes in two stages. Blocks of DRAW_BLOCK tokens are summed (float32: a float64
    reduction costs 16x here) and their running sums (float64) pick the block; then the block's
    own running sum (float64) picks the token for the uniform's place inside the block, U' =
    (U * total - before) / block sum, kept below 1. Every token keeps an interval in proportion
    to its weight (the float32 block sums move a block's share by ~1e-7 of itself); a token or
    block of weight 0 never raises a running sum, so it is never the first to exceed a target
    (U = 0 takes the first token of positive weight). The caller still checks the drawn weight:
    a parallel scan (CUDA's cumsum) may give a weight-0 token an ulp."""
    vocab = weights.shape[-1]
    if vocab <= DRAW_BLOCK:
        return _first_exceeding(weights, uniform.unsqueeze(1))
    full = vocab // DRAW_BLOCK
    block_sums = weights[:, :full * DRAW_BLOCK].unflatten(1, (full, DRAW_BLOCK)).sum(dim=-1)
    if vocab > full * DRAW_BLOCK:
        block_sums = torch.cat([block_sums, weights[:, full * DRAW_BLOCK:].sum(dim=-1, keepdim=True)], dim=1)
    block_ends = block_sums.cumsum(dim=-1, dtype=torch.float64)
    block_starts = torch.nn.functional.pad(block_ends, (1, 0))  # [:, b]: the running sum before block b
    target = uniform.unsqueeze(1) * block_ends[:, -1:]
    block = torch.searchsorted(block_ends, target, right=True).clamp_(max=block_sums.shape[1] - 1)
    inside = ((target - block_starts.gather(1, block)) / block_sums.gather(1, block)).clamp_(0.0, _BELOW_ONE)
    tokens = block * DRAW_BLOCK + torch.arange(DRAW_BLOCK, device=weights.device)
    inner = weights.gather(1, tokens.clamp(max=vocab - 1)).masked_fill_(tokens >= vocab, 0.0)
    offset = _first_exceeding(inner, inside)
    token = block * DRAW_BLOCK + offset
    return torch.where((offset < DRAW_BLOCK) & (token < vocab), token, vocab)


def _first_exceeding(weights: torch.Tensor, fraction: torch.Tensor) -> torch.Tensor:
    """[B, 1] per row the first index whose running sum (float64) exceeds `fraction` (in [0, 1),
    [B, 1]) times the row's total; the row's length where none does. fraction < 1 (at most
    1 - 2^-53), so fraction * total rounds below the total, which an in-order sum reaches."""
    cumulative = weights.cumsum(dim=-1, dtype=torch.float64)
    return torch.searchsorted(cumulative, fraction * cumulative[:, -1:], right=True)


class Sampler:
    def __init__(self, cpu_kernels: CpuKernels | None = None):
        self.cpu_kernels = cpu_kernels  # masks CPU float32 logits with a grammar's bitmask

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        raw = logits
        if batch.token_bitmask is not None:
            logits = logits.clone() if bool((batch.num_logprobs >= 0).any()) else logits
            apply_token_bitmask(logits, batch.token_bitmask, batch.bitmask_rows, self.cpu_kernels)
        if batch.seen_token_ids is not None or batch.output_token_ids is not None:
            logits = apply_penalties(logits, batch)
        if batch.banned is not None:
            logits = logits.index_put(batch.banned, torch.tensor(_MASKED, dtype=logits.dtype))
        greedy = batch.temperature < GREEDY_TEMPERATURE_EPS
        token_ids = argmax_rows(logits)
        if not bool(greedy.all()):
            token_ids = self._draw(logits, batch, greedy, token_ids)
        output = SamplerOutput(token_ids=token_ids)
        if bool((batch.num_logprobs >= 0).any()):
            self._logprobs(raw, batch, output)
        return output

    def _draw(self, logits: torch.Tensor, batch: SamplingBatch, greedy: torch.Tensor,
              argmax: torch.Tensor) -> torch.Tensor:
        """[B] each sampled row's draw; greedy rows, and rows with no finite largest logit (all
        masked, or an infinite one: no distribution to draw from), keep their argmax."""
        temperature = torch.where(greedy, torch.ones_like(batch.temperature), batch.temperature)
        # A new tensor (the division), so the in-place steps below never touch the caller's logits.
        logits = restrict_logits(logits / temperature.unsqueeze(1), batch.top_k, batch.top_p, batch.min_p)
        top = logits.amax(dim=-1, keepdim=True)  # max()'s values-and-indices was 20x slower here
        drawable = torch.isfinite(top).squeeze(1) & ~greedy
        weights = logits.sub_(top).exp_()
        uniform = torch.rand(len(logits), dtype=torch.float64, device=logits.device)
        for row, generator in enumerate(batch.generators):
            if generator is not None:
                row_seed = batch.seeds[row]
                assert row_seed is not None, "a row has a generator only with a seed"
                seed = (row_seed * _SEED_MIX + batch.positions[row]) & 0x7FFFFFFFFFFFFFFF
                generator.manual_seed(seed)
                uniform[row:row + 1].uniform_(generator=generator)
        drawn = inverse_transform(weights, uniform)
        # A parallel scan (CUDA's cumsum) may add in another order, leaving a weight-0 token an
        # interval of an ulp, or a running sum that never exceeds its target (drawn = vocab); a
        # masked token must never be drawn, so such a draw takes the argmax (always kept: no
        # restriction drops a row's maximum).
        vocab = weights.shape[-1]
        kept = (drawn < vocab) & (weights.gather(1, drawn.clamp(max=vocab - 1)) > 0)
        return torch.where(drawable & kept.squeeze(1), drawn.squeeze(1), argmax)

    @staticmethod
    def _logprobs(raw: torch.Tensor, batch: SamplingBatch, output: SamplerOutput) -> None:
        rows = torch.nonzero(batch.num_logprobs >= 0).squeeze(1)
        logprobs = raw[rows].float().log_softmax(dim=-1)
        sampled = output.token_ids[rows]
        sampled_lp = logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1)
        output.logprob_rows = rows
        output.sampled_logprobs = sampled_lp
        output.sampled_ranks = (logprobs > sampled_lp.unsqueeze(1)).sum(dim=-1) + 1
        max_n = int(batch.num_logprobs[rows].max())
        top = logprobs.topk(max_n, dim=-1) if max_n > 0 else None
        output.top_logprobs = top.values if top else logprobs[:, :0]
        output.top_token_ids = top.indices if top else sampled[:, None][:, :0]
