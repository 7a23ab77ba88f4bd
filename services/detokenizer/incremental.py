"""Incremental detokenization of one request: valid UTF-8 text deltas, stop strings and
output modes. Multi-byte characters split across tokens (and byte-fallback tokens) are held
by tokenizers' DecodeStream until they complete, so every delta is valid text."""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from vmesh.services.common.types import PROMPT_TAIL_TOKENS, OutputMode, SamplingParams


@dataclass
class DetokenizerOutput:
    text: str  # what to send now, per the output mode
    stop_hit: bool  # a stop string matched: the request is finished and must be aborted upstream
    finished: bool


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, prompt_token_ids: list[int] | None = None):
        self.tokenizer = tokenizer
        self.params = params
        context = list(prompt_token_ids or [])[-PROMPT_TAIL_TOKENS:]  # decoding context (see PROMPT_TAIL_TOKENS)
        self.stream = DecodeStream(ids=context, skip_special_tokens=params.skip_special_tokens)
        self.text = ""
        self.num_tokens = 0
        self.emitted = 0  # characters of self.text already sent
        self.checked = 0  # characters of self.text already searched for stop strings
        self.finished = False
        self.max_stop_len = max((len(s) for s in params.stop), default=0)

    def resume(self, token_ids: list[int], text_length: int) -> None:
        """Continue a request another replica was serving: decode the tokens it had produced,
        of whose text the client already has the first `text_length` characters (the rest was
        held back, for a stop string or an unfinished character, and goes out with the next
        output). Decoding is deterministic, so the text is the one the client saw."""
        for token in token_ids:
            self.num_tokens += 1
            self.text += self.stream.step(self.tokenizer, token) or ""
        self.checked = len(self.text)  # no stop string ended in it: that replica would have seen it
        self.emitted = min(text_length, len(self.text))

    def update(self, token_ids: list[int], finished: bool = False) -> DetokenizerOutput:
        stop_hit = False
        for token in token_ids:
            if self.finished:
                break
            self.num_tokens += 1
            piece = self.stream.step(self.tokenizer, token)
            if piece:
                self.text += piece
            if self.params.stop and self._cut_at_stop_string():
                stop_hit = True
                self.finished = True
        self.finished = self.finished or finished
        end = len(self.text) if self.finished else len(self.text) - self._held_back()
        return DetokenizerOutput(self._render(max(end, self.emitted)), stop_hit, self.finished)

    def _cut_at_stop_string(self) -> bool:
        start = max(0, self.checked - self.max_stop_len + 1)
        self.checked = len(self.text)
        if self.num_tokens < self.params.min_tokens:
            return False
        hits = [(i, s) for s in self.params.stop if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        self.text = self.text[:index + len(stop) if self.params.include_stop_str_in_output else index]
        return True

    def _held_back(self) -> int:
        """Length of the longest tail of the text that could still grow into a stop string."""
        for n in range(min(self.max_stop_len - 1, len(self.text)), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.params.stop):
                return n
        return 0

    def _render(self, end: int) -> str:
        delta = self.text[self.emitted:end]
        self.emitted = end
        mode = self.params.output_mode
        if mode is OutputMode.DELTA:
            return delta
        if mode is OutputMode.CUMULATIVE:
            return self.text[:end]
        return self.text if self.finished else ""
