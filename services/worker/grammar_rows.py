"""The grammar matchers of the worker's persistent batch: one per row whose request carries a
compiled grammar, built when the row is added and replaying the output tokens the request already
has (a preempted or recomputed request, a resumed failover, the stateless worker's rebuild), so
that it stands where the request's output stands. A matcher moves with its row.

Each step the runner asks `fill` for the bitmask of the rows that sample (on a helper thread,
while the model computes) and, once sampled, `advance`s each matcher by its row's token. A
matcher that cannot load, rejects a token (a bug somewhere) or raises fails its request alone:
the row is marked failed with a message, which the step's result reports once, and from then on
the row is neither masked nor advanced (its tokens are not reported: the request is ending).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from vmesh.services.common.model_spec import ModelSpec
from vmesh.services.common.structured import RowMatcher, allocate_token_bitmask, load_matcher
from vmesh.services.common.types import SamplingParams


@dataclass(frozen=True)
class GrammarTokenizer:
    """What a model's grammars are compiled and matched against: its tokenizer.json, its logits'
    width and its EOS ids, which are the grammars' stop tokens (allowed only where the grammar
    accepts; the scheduler stops a request on them)."""
    tokenizer_json: Path
    vocab_size: int
    stop_token_ids: tuple[int, ...]

    @classmethod
    def for_model(cls, model_dir: Path, spec: ModelSpec) -> GrammarTokenizer | None:
        """None for a model directory without tokenizer.json (its grammars fail their requests)."""
        path = model_dir / "tokenizer.json"
        return cls(path, spec.vocab_size, tuple(spec.eos_token_ids)) if path.is_file() else None


class RowGrammar:
    """One request's matcher and the output tokens it has accepted (or why it failed)."""

    def __init__(self, matcher: RowMatcher | None, error: str = ""):
        self.matcher = matcher
        self.accepted: list[int] = []
        self.error = error  # non-empty: the request fails with this message
        self.error_reported = False

    @property
    def active(self) -> bool:
        """Masks and advances: loaded, not failed, and not yet terminated."""
        return self.matcher is not None and not self.error and not self.matcher.is_terminated()

    def fail(self, error: str) -> None:
        if not self.error:
            self.error = error

    def sync(self, output_token_ids: Sequence[int]) -> None:
        """Stand where `output_token_ids` end: keep the common prefix with what was accepted,
        roll back the rest, accept what is new."""
        if self.matcher is None or self.error:
            return
        common = 0
        for mine, theirs in zip(self.accepted, output_token_ids):
            if mine != theirs:
                break
            common += 1
        try:
            if common < len(self.accepted):
                self.matcher.rollback(len(self.accepted) - common)
                del self.accepted[common:]
            for token in output_token_ids[common:]:
                self.advance(token)
                if self.error:
                    return
        except Exception as exc:  # a backend error is this request's, never the worker's
            self.fail(f"the grammar matcher failed replaying the request's output: {exc}")

    def advance(self, token_id: int) -> None:
        assert self.matcher is not None, "only a loaded matcher advances"
        try:
            accepted = self.matcher.accept(token_id)
        except Exception as exc:
            self.fail(f"the grammar matcher failed on token {token_id}: {exc}")
            return
        if not accepted:
            self.fail(f"the grammar matcher rejected token {token_id} after {len(self.accepted)} output tokens")
            return
        self.accepted.append(token_id)


def row_grammar(params: SamplingParams, tokenizer: GrammarTokenizer | None) -> RowGrammar | None:
    """The row's matcher at the grammar's start; None for a request without structured output."""
    if params.grammar is None:
        if params.structured is not None:  # never enforce nothing where something was asked for
            return RowGrammar(None, "the request's structured output reached the worker uncompiled")
        return None
    if tokenizer is None:
        return RowGrammar(None, "this worker's model has no tokenizer.json to enforce a grammar with")
    try:
        return RowGrammar(load_matcher(params.grammar, tokenizer.tokenizer_json, tokenizer.vocab_size,
                                       list(tokenizer.stop_token_ids)))
    except Exception as exc:  # a payload that does not load fails its request alone
        return RowGrammar(None, f"the request's {params.grammar.backend} grammar does not load: {exc}")


class GrammarMask:
    """The step's packed token bitmask (int32 [rows, ceil(vocab / 32)]), reused across steps."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._bitmask: torch.Tensor | None = None

    def fill(self, num_rows: int, grammars: Sequence[tuple[int, RowGrammar]]) -> torch.Tensor:
        """The bitmask of a step of `num_rows`, filled at the rows listed with their grammars
        (the other rows are stale: the sampler applies only the listed ones). A matcher that
        raises fails its request; its row then allows every token."""
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            self._bitmask = allocate_token_bitmask(max(num_rows, 8), self.vocab_size)
        bitmask = self._bitmask[:num_rows]
        for row, grammar in grammars:
            assert grammar.matcher is not None, "only active grammars are masked"
            try:
                grammar.matcher.fill_bitmask(bitmask, row)
            except Exception as exc:
                grammar.fail(f"the grammar matcher failed filling its token mask: {exc}")
                bitmask[row] = -1
        return bitmask
