"""The suffix method's cache of recent outputs (vLLM's `suffix_decoding_max_cached_requests`).

The worker keeps the output tokens of the last N requests to leave its batch. A decoding row
whose latest tokens also ended somewhere in one of those outputs may propose what followed
there: requests of one deployment often answer alike (the same tool calls, templates, JSON
keys, a question asked again), and their own prompts do not hold those answers. Every rank of
a tensor-parallel group sees the same plans, so each keeps the same cache and proposes the same
drafts. Drafts only change speed: verification keeps outputs exact whatever is proposed.

Matching is two tensor passes, never a loop over rows or cached tokens: one comparison of each
row's last token against every cached token (the cost grows with the cache: rows x cached
tokens a step), then the few places that matched are extended one depth at a time.
"""

from __future__ import annotations

from collections import deque

import torch

# Between two outputs in the joined cache: no token equals it, so a match never crosses it and
# a proposal stops at it.
SEPARATOR = -1


class RecentOutputs:
    def __init__(self, max_requests: int):
        if max_requests < 1:
            raise ValueError(f"RecentOutputs needs max_requests >= 1, got {max_requests}")
        self.max_requests = max_requests
        self._outputs: deque[torch.Tensor] = deque(maxlen=max_requests)
        self._joined: torch.Tensor | None = None
        self._separators: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self._outputs)

    def add(self, output_token_ids: torch.Tensor) -> None:
        """Keep one request's output tokens (the oldest kept output goes when the cache is full)."""
        if len(output_token_ids) >= 2:  # one token predicts nothing after itself
            self._outputs.append(output_token_ids.detach().to("cpu", torch.int64).clone())
            self._joined = None

    def clear(self) -> None:
        self._outputs.clear()
        self._joined = None

    @property
    def joined(self) -> torch.Tensor:
        """Every kept output, oldest first, each followed by SEPARATOR."""
        if self._joined is None:
            ends = torch.full((1,), SEPARATOR, dtype=torch.int64)
            self._joined = torch.cat([part for output in self._outputs for part in (output, ends)]) \
                if self._outputs else torch.zeros(0, dtype=torch.int64)
            self._separators = torch.nonzero(self._joined == SEPARATOR).squeeze(1)
        return self._joined

    def longest_matches(self, tokens: torch.Tensor, lengths: torch.Tensor,
                        max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(length [R], end [R]): for each row (its tokens in the first lengths[r] columns of
        `tokens`), the longest run of cached tokens, up to max_depth, equal to the row's last
        tokens and followed by at least one more token of the same output; the latest such run
        on a tie. `end` is the position in `joined` of the run's last token; length 0 where
        nothing matched."""
        rows = len(lengths)
        joined = self.joined
        length = torch.zeros(rows, dtype=torch.int64)
        end = torch.zeros(rows, dtype=torch.int64)
        if not rows or len(joined) < 2:
            return length, end
        last = tokens.gather(1, (lengths - 1).clamp(min=0)[:, None])
        # A run that ends right before a separator has nothing to propose after it.
        followed = torch.cat([joined[1:] != SEPARATOR, torch.zeros(1, dtype=torch.bool)])
        hit_row, hit_end = torch.nonzero((joined[None, :] == last) & followed[None, :], as_tuple=True)
        run = torch.ones(len(hit_row), dtype=torch.int64)
        alive = torch.arange(len(hit_row))
        for depth in range(1, max_depth):
            row, position = hit_row[alive], hit_end[alive] - depth
            back = lengths[row] - 1 - depth
            same = joined[position.clamp(min=0)] == tokens[row, back.clamp(min=0)]
            alive = alive[same & (position >= 0) & (back >= 0)]
            if not len(alive):
                break
            run[alive] += 1
        # The longest run, then the latest: one maximum per row over a combined score.
        score = torch.full((rows,), -1, dtype=torch.int64)
        score.scatter_reduce_(0, hit_row, run * len(joined) + hit_end, reduce="amax")
        matched = score >= 0
        length = torch.where(matched, score // len(joined), 0)
        end = torch.where(matched, score % len(joined), 0)
        return length, end

    def proposals(self, end: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(drafts [R, k], available [R]): the k cached tokens after each `end` and how many of
        them belong to the same output (a proposal never runs into the next output)."""
        joined = self.joined
        start = end + 1
        assert self._separators is not None  # set with joined
        next_separator = self._separators[torch.searchsorted(self._separators, start).clamp(
            max=len(self._separators) - 1)]
        offsets = (start[:, None] + torch.arange(k)[None, :]).clamp(max=len(joined) - 1)
        return joined[offsets], (next_separator - start).clamp(min=0)
