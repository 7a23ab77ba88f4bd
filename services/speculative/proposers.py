"""Draft proposals from each row's own tokens (prompt and output), for a whole batch at once.

Both methods look for an earlier place where the row's latest tokens occurred and propose what
followed there:
- ngram (prompt lookup, vLLM's `prompt_lookup_min/max`): the longest suffix of n tokens,
  prompt_lookup_min <= n <= prompt_lookup_max, that occurred before; k tokens follow it.
- suffix: the longest suffix match up to the tree depth, proposing at most spec_factor times its
  length (a long match predicts more than a short one); a match of one token is enough.
Ties go to the latest occurrence (recent text predicts best). The matching is one pass per
compared depth over a [rows, tokens] tensor, never a loop over the batch. With
`suffix_decoding_max_cached_requests`, the suffix method also matches the outputs of recent
requests (recent_outputs.py) and proposes from there where that match is the longer one.
"""

from __future__ import annotations

import torch

from vmesh.services.speculative.config import SpeculativeConfig
from vmesh.services.speculative.recent_outputs import RecentOutputs


def suffix_match_lengths(tokens: torch.Tensor, lengths: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[R, W] int64: for each row r and end position i < lengths[r] - 1, how many tokens ending
    at i equal the row's last tokens (its tokens ending at lengths[r] - 1), up to max_depth.
    `tokens`: [R, W] with each row's tokens in its first lengths[r] columns."""
    rows, width = tokens.shape
    column = torch.arange(width)
    alive = column[None, :] < (lengths - 1)[:, None]
    matched = torch.zeros(rows, width, dtype=torch.int64)
    for depth in range(max_depth):
        back = lengths - 1 - depth  # the suffix's token `depth` places from the end
        wanted = tokens.gather(1, back.clamp(min=0)[:, None])
        earlier = tokens if depth == 0 else torch.nn.functional.pad(tokens[:, :width - depth], (depth, 0), value=-1)
        alive &= (earlier == wanted) & (back >= 0)[:, None] & (column >= depth)[None, :]
        if not bool(alive.any()):
            break
        matched += alive
    return matched


def propose(config: SpeculativeConfig, tokens: torch.Tensor, lengths: torch.Tensor,
            max_drafts: torch.Tensor, recent: RecentOutputs | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(drafts [R, k] int64, num_drafts [R] int64): each row's proposal, at most max_drafts[r]
    (the slots the scheduler reserved) and never past the row's known tokens (or the cached
    output it came from). Rows without a match propose nothing. `recent`: the suffix method's
    cache of recent outputs, whose match wins where it is strictly longer than the row's own."""
    k = config.num_speculative_tokens
    rows, width = tokens.shape
    matched = suffix_match_lengths(tokens, lengths, config.max_match_length)
    if not rows:
        return torch.zeros(0, k, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    # The longest match, then the latest: one argmax over a combined score.
    score = matched * width + torch.arange(width)[None, :]
    end = score.argmax(dim=1)
    length = matched.gather(1, end[:, None]).squeeze(1)
    start = end + 1  # the first token that followed the match
    available = lengths - start
    offsets = start[:, None] + torch.arange(k)[None, :]
    drafts = tokens.gather(1, offsets.clamp(max=width - 1))
    if recent is not None and len(recent) and config.method == "suffix":
        found, cached_end = recent.longest_matches(tokens.numpy(), lengths.numpy(), config.max_match_length)
        numpy_drafts, numpy_available = recent.proposals(cached_end, k)
        cached_length = torch.from_numpy(found)
        cached_drafts, cached_available = torch.from_numpy(numpy_drafts), torch.from_numpy(numpy_available)
        from_cache = cached_length > length
        length = torch.where(from_cache, cached_length, length)
        available = torch.where(from_cache, cached_available, available)
        drafts = torch.where(from_cache[:, None], cached_drafts, drafts)
    count = torch.minimum(available, max_drafts.clamp(max=k))
    if config.method == "suffix":
        count = torch.minimum(count, (length.double() * config.suffix_decoding_max_spec_factor).floor().long())
    count = torch.where(length >= config.min_match_length, count, 0).clamp(min=0)
    drafts = drafts.masked_fill(torch.arange(k)[None, :] >= count[:, None], 0)
    return drafts, count
