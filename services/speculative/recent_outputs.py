"""The suffix method's cache of recent outputs (`suffix_decoding_max_cached_requests`).

The worker keeps the output tokens of the last N requests to leave its batch. A decoding row
whose latest tokens also ended somewhere in one of those outputs may propose what followed
there: requests of one deployment often answer alike (the same tool calls, templates, JSON
keys, a question asked again), and their own prompts do not hold those answers. Every rank of
a tensor-parallel group applies the same plans, so each keeps the same cache and proposes the
same drafts. Drafts only change speed: verification keeps outputs exact whatever is proposed.

Layout: one ring of token ids addressed by absolute position (a token written at p lies at
p % capacity while p >= the oldest kept output's start), a separator after each output, and for
each position the previous position holding the same token, with the latest position of each
token id: a chain per token, newest first, as a compressor's match finder keeps. A step looks
at the CANDIDATES latest places each row's last token occurred (a walk of that many lookups),
then compares the tokens before those places with the row's in
one [rows, candidates, depth] pass, so its cost does not grow with the cache. Adding an output
costs a sort of its tokens.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

SEPARATOR = -1  # after each output: no token equals it, so no match crosses it and no proposal passes it
CANDIDATES = 32  # places of the row's last token a step compares, latest first
# The ring's budget: the newest N outputs, as long as they hold this many tokens on average.
TOKENS_PER_REQUEST = 1024
_INITIAL_CAPACITY = 4096


class RecentOutputs:
    def __init__(self, max_requests: int, max_tokens: int | None = None):
        if max_requests < 1:
            raise ValueError(f"RecentOutputs needs max_requests >= 1, got {max_requests}")
        self.max_requests = max_requests
        self.max_tokens = max_tokens or max_requests * TOKENS_PER_REQUEST
        if self.max_tokens < 3:
            raise ValueError(f"RecentOutputs needs room for two tokens and a separator, got max_tokens={max_tokens}")
        self._capacity = 0
        self._tokens = np.zeros(0, dtype=np.int64)
        self._previous = np.zeros(0, dtype=np.int64)  # the same token's previous absolute position, or -1
        self._latest = np.full(0, -1, dtype=np.int64)  # by token id: its latest absolute position, or -1
        self._written = 0  # the absolute position the next token goes to
        self._oldest = 0  # the start of the oldest kept output: positions before it are gone
        self._spans: OrderedDict[int, tuple[int, int]] = OrderedDict()  # key -> [start, end) of its tokens

    def __len__(self) -> int:
        return len(self._spans)

    def clear(self) -> None:
        self._spans.clear()
        self._oldest = self._written
        self._latest[:] = -1

    def add(self, key: int, output_token_ids: np.ndarray) -> None:
        """Keep one request's output tokens under `key` (its handle, which a scheduler never
        reuses), replacing what an earlier removal of the same request (a preemption) left; the
        oldest outputs go past max_requests or max_tokens."""
        self.forget(key)
        tokens = np.asarray(output_token_ids, dtype=np.int64)[-(self.max_tokens - 1):]
        if len(tokens) < 2:  # one token predicts nothing after itself
            return
        while self._spans and (len(self._spans) >= self.max_requests
                               or self._written + len(tokens) + 1 - self._oldest > self.max_tokens):
            self._spans.popitem(last=False)
            self._oldest = next(iter(self._spans.values()))[0] if self._spans else self._written
        self._reserve(self._written + len(tokens) + 1 - self._oldest, int(tokens.max()))
        start = self._written
        positions = start + np.arange(len(tokens))
        self._tokens[positions % self._capacity] = tokens
        self._tokens[(start + len(tokens)) % self._capacity] = SEPARATOR
        self._previous[(start + len(tokens)) % self._capacity] = -1
        # Chain each position to the previous one of its token: within the output by a stable sort,
        # the output's first of each token to that token's latest place before it.
        order = np.argsort(tokens, kind="stable")
        ordered, places = tokens[order], positions[order]
        first_of_token = np.ones(len(ordered), dtype=bool)
        first_of_token[1:] = ordered[1:] != ordered[:-1]
        previous = np.empty(len(ordered), dtype=np.int64)
        previous[1:] = places[:-1]
        previous[first_of_token] = self._latest[ordered[first_of_token]]
        self._previous[places % self._capacity] = previous
        last_of_token = np.ones(len(ordered), dtype=bool)
        last_of_token[:-1] = ordered[1:] != ordered[:-1]
        self._latest[ordered[last_of_token]] = places[last_of_token]
        self._written = start + len(tokens) + 1
        self._spans[key] = (start, start + len(tokens))

    def forget(self, key: int) -> None:
        """Drop the output kept under `key`, if any: its tokens become separators (chains pass
        through them and match nothing there)."""
        span = self._spans.pop(key, None)
        if span is not None and span[0] >= self._oldest:
            self._tokens[np.arange(*span) % self._capacity] = SEPARATOR

    def _reserve(self, tokens_kept: int, largest_token_id: int) -> None:
        if tokens_kept > self._capacity:
            capacity = min(max(2 * self._capacity, tokens_kept, _INITIAL_CAPACITY), self.max_tokens)
            kept = np.arange(self._oldest, self._written)
            tokens, previous = np.zeros(capacity, dtype=np.int64), np.full(capacity, -1, dtype=np.int64)
            if self._capacity:
                tokens[kept % capacity] = self._tokens[kept % self._capacity]
                previous[kept % capacity] = self._previous[kept % self._capacity]
            self._tokens, self._previous, self._capacity = tokens, previous, capacity
        if largest_token_id >= len(self._latest):
            latest = np.full(max(2 * len(self._latest), largest_token_id + 1), -1, dtype=np.int64)
            latest[:len(self._latest)] = self._latest
            self._latest = latest

    def longest_matches(self, tokens: np.ndarray, lengths: np.ndarray,
                        max_depth: int) -> tuple[np.ndarray, np.ndarray]:
        """(length [R], end [R]): for each row (its tokens in the first lengths[r] columns of
        `tokens`), among the CANDIDATES latest kept places of its last token that another token
        of the same output follows, the longest run of kept tokens ending there equal to the row's
        last tokens, up to max_depth (the latest on a tie). `end` is the absolute position of the
        run's last token; length 0 where nothing matched."""
        rows = len(lengths)
        length, end = np.zeros(rows, dtype=np.int64), np.zeros(rows, dtype=np.int64)
        if not rows or not self._spans:
            return length, end
        row_index = np.arange(rows)
        last = tokens[row_index, lengths - 1]
        # Following a chain is a list walk, one lookup after another: in Python it costs ~0.3 us a
        # place, where an array op over the rows costs several (a step has a few rows, at most 15
        # under the default disable_by_batch_size).
        candidates = np.full((rows, CANDIDATES), -1, dtype=np.int64)
        previous, capacity, oldest = self._previous, self._capacity, self._oldest
        for row, token in enumerate(last.tolist()):
            place = int(self._latest[token]) if token < len(self._latest) else -1
            column = 0
            while place >= oldest and column < CANDIDATES:
                candidates[row, column] = place
                place = int(previous[place % capacity])
                column += 1
        # Every candidate against the row's last max_depth tokens at once: [rows, candidates, depth].
        # A kept place on the chain holds the row's last token, or a separator where its output was
        # forgotten; the outputs' last places have nothing after them to propose.
        depths = np.arange(max_depth)
        positions = candidates[:, :, None] - depths
        back = lengths[:, None] - 1 - depths
        wanted = tokens[row_index[:, None], np.maximum(back, 0)]
        same = ((positions >= self._oldest) & (back >= 0)[:, None, :]
                & (self._tokens[positions % self._capacity] == wanted[:, None, :]))
        same[:, :, 0] &= self._tokens[(candidates + 1) % self._capacity] != SEPARATOR
        run = np.cumprod(same, axis=2).sum(axis=2)
        # The longest run, then the latest place (candidates come latest first).
        best = np.argmax(run * (self._written + 1) + candidates, axis=1)
        length = run[row_index, best]
        end = np.where(length > 0, candidates[row_index, best], 0)
        return length, end

    def proposals(self, end: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(drafts [R, k], available [R]): the k kept tokens after each `end` (an absolute position
        longest_matches returned) and how many of them lead up to the output's separator: a
        proposal never runs into the next output. Past `available` the columns are meaningless."""
        if not self._capacity:
            return np.zeros((len(end), k), dtype=np.int64), np.zeros(len(end), dtype=np.int64)
        drafts = self._tokens[(end[:, None] + 1 + np.arange(k)[None, :]) % self._capacity]
        available = np.cumprod(drafts != SEPARATOR, axis=1).sum(axis=1)
        return drafts, available
