"""The worker's side: one matcher per request (a persistent-batch row) over a CompiledGrammar,
behind one interface for both backends, and the packed token bitmask applied to the logits.

A bitmask is int32 [rows, ceil(vocab_size / 32)], bit i of word j allowing token 32 * j + i
(both backends write this layout). Stop tokens are allowed only where the grammar accepts;
accepting one terminates the matcher."""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import llguidance
import torch
import xgrammar

from vmesh.services.common.structured.vocabulary import Vocabulary, shared_vocabulary
from vmesh.services.common.types import CompiledGrammar

if TYPE_CHECKING:
    from vmesh.kernels.cpu_native import CpuKernels

# Deserialized xgrammar grammars kept per process, by key (a few hundred KB each at most).
XGRAMMAR_CACHE_SIZE = 256


class RowMatcher(Protocol):
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into bitmask[row] (a CPU int32 tensor)."""

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False (and the matcher unchanged or in error) when not allowed."""

    def is_terminated(self) -> bool:
        """A stop token was accepted: the output is complete."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens."""


class _XgrammarRow:
    def __init__(self, compiled: xgrammar.CompiledGrammar):
        self._matcher = xgrammar.GrammarMatcher(compiled, max_rollback_tokens=-1)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)


class _LlguidanceRow:
    def __init__(self, vocabulary: Vocabulary, grammar: str):
        self._matcher = llguidance.LLMatcher(vocabulary.llguidance_tokenizer, grammar, log_level=0)
        self._stop_token_ids = frozenset(vocabulary.stop_token_ids)
        self._terminated = False
        if self._matcher.is_error():
            raise ValueError(f"llguidance cannot load the grammar: {self._matcher.get_error()}")

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        # The matcher writes the row's words itself. Not through llguidance.torch: importing it
        # compiles a kernel we never call (torch.compile at import), which pulls torch._dynamo and
        # torch._inductor into every worker and costs seconds of each start and exit.
        words = bitmask[row]
        if bitmask.dtype != torch.int32 or not bitmask.is_cpu or not words.is_contiguous():
            raise ValueError("the bitmask must be a contiguous CPU int32 tensor")
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())

    def accept(self, token_id: int) -> bool:
        if self._terminated or self._matcher.is_error():
            return False
        accepted = bool(self._matcher.consume_token(token_id))
        if accepted and token_id in self._stop_token_ids:
            self._terminated = True  # llguidance stops, but counts no termination of its own
        return accepted

    def is_terminated(self) -> bool:
        return self._terminated

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and self._terminated:
            self._terminated = False
        self._matcher.rollback(num_tokens)


_xgrammar_compiled: OrderedDict[str, xgrammar.CompiledGrammar] = OrderedDict()
_xgrammar_lock = threading.Lock()


def _deserialized_xgrammar(grammar: CompiledGrammar, vocabulary: Vocabulary) -> xgrammar.CompiledGrammar:
    cache_key = f"{grammar.key}/{vocabulary.identity}"
    with _xgrammar_lock:
        compiled = _xgrammar_compiled.get(cache_key)
        if compiled is not None:
            _xgrammar_compiled.move_to_end(cache_key)
            return compiled
    compiled = xgrammar.CompiledGrammar.deserialize_json(grammar.payload.decode(), vocabulary.xgrammar_info)
    with _xgrammar_lock:
        _xgrammar_compiled[cache_key] = compiled
        while len(_xgrammar_compiled) > XGRAMMAR_CACHE_SIZE:
            _xgrammar_compiled.popitem(last=False)
    return compiled


def load_matcher(grammar: CompiledGrammar, tokenizer_json: str | Path | bytes, vocab_size: int,
                 stop_token_ids: list[int]) -> RowMatcher:
    """A fresh matcher at the grammar's start (replay a request's output tokens with accept).
    The tokenizer arguments are the compiler's: the vocabulary is built once per process."""
    vocabulary = shared_vocabulary(tokenizer_json, vocab_size, stop_token_ids)
    if grammar.backend == "xgrammar":
        return _XgrammarRow(_deserialized_xgrammar(grammar, vocabulary))
    if grammar.backend == "llguidance":
        return _LlguidanceRow(vocabulary, grammar.payload.decode())
    raise ValueError(f"unknown grammar backend {grammar.backend!r}")


def allocate_token_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A CPU int32 bitmask for `rows` rows, every token allowed."""
    return xgrammar.allocate_token_bitmask(rows, vocab_size)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None,
                        cpu_kernels: CpuKernels | None = None) -> None:
    """Set the disallowed tokens' logits to -inf in place. logits: [B, vocab] on any device;
    bitmask: [B, ceil(vocab / 32)] int32 (moved to the logits' device); rows: the logits rows
    to mask (None: all), indexing both tensors. `cpu_kernels`: float32 CPU logits are masked by
    vmesh/kernels/cpu/token_bitmask.c (a tenth of xgrammar's CPU kernel's time), the rest by xgrammar."""
    if (cpu_kernels is not None and logits.device.type == "cpu" and logits.dtype == torch.float32
            and logits.dim() == 2 and logits.stride(1) == 1):
        cpu_kernels.apply_token_bitmask(logits, bitmask, rows)
        return
    xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                         vocab_size=logits.shape[-1], indices=rows)
