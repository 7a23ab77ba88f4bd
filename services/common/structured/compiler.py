"""GrammarCompiler: a structured-output request compiled once, by the backend that can enforce
it, under a size and a time budget, and cached by its key.

Backends: "auto" compiles with xgrammar, and falls back to llguidance only for what xgrammar
cannot enforce but llguidance can (a Lark grammar, a schema with allOf or patternProperties, a
regex only Rust's syntax takes, a grammar whose xgrammar payload is over max_payload_bytes);
a backend the client named is used or the request is refused.
Never unconstrained: every path ends in a grammar or a GrammarRefused.

The "grammar" kind is EBNF (GBNF, xgrammar's dialect with `root ::= ...`) when its text has a
`::=`, otherwise Lark (`start: ...`). Auto compiles EBNF with xgrammar and Lark with llguidance
(llguidance's own syntax); named explicitly, xgrammar takes Lark too and llguidance takes GBNF.

Time budget: each compile runs on a small pool of threads and the caller waits at most
`time_budget_s`. A compile past it is refused (GrammarRefused naming the budget) and its request
key remembered, so a repeat is refused at once. The backends cannot be interrupted: the
over-budget compile keeps its thread until it ends, and its result is dropped. The pool is
bounded (COMPILE_THREADS), so runaway compiles cannot take more than those threads; requests
queued behind them wait within their own budget and are refused when it runs out.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import threading
from collections import OrderedDict
from pathlib import Path

import xgrammar

from vmesh.services.common.structured.backends import GrammarRefused, compile_llguidance, compile_xgrammar
from vmesh.services.common.structured.vocabulary import Vocabulary, shared_vocabulary
from vmesh.services.common.types import GRAMMAR_BACKENDS, STRUCTURED_KINDS, CompiledGrammar, StructuredOutput

COMPILE_THREADS = 2
# Requests that timed out, remembered (by request key) so a repeat is refused without compiling.
MAX_REMEMBERED_OVER_BUDGET = 4096
_XGRAMMAR_ONLY_KINDS = ("structural_tag",)
# A compiled grammar travels inside the worker link's messages (gRPC's default limit: 4 MiB).
# xgrammar's serialized token-mask cache grows with the schema (a 60-property object: ~17 MB);
# over this, "auto" takes llguidance (whose payload is its small grammar text) instead.
MAX_PAYLOAD_BYTES = 2 * 1024 * 1024


def grammar_key(backend: str, kind: str, source: str, tokenizer_identity: str) -> str:
    return hashlib.sha256(json.dumps([backend, kind, source, tokenizer_identity]).encode()).hexdigest()


class GrammarCompiler:
    """Compiles StructuredOutputs for one model's tokenizer; `compile` is blocking and thread-safe."""

    def __init__(self, tokenizer_json: str | Path | bytes, vocab_size: int, stop_token_ids: list[int],
                 time_budget_s: float = 5.0, max_source_bytes: int = 64 * 1024, cache_size: int = 256,
                 max_payload_bytes: int = MAX_PAYLOAD_BYTES):
        self.vocabulary: Vocabulary = shared_vocabulary(tokenizer_json, vocab_size, stop_token_ids)
        self.time_budget_s = time_budget_s
        self.max_source_bytes = max_source_bytes
        self.cache_size = cache_size
        self.max_payload_bytes = max_payload_bytes
        # Our own cache (by request) replaces xgrammar's, which would hold every grammar twice.
        self._xgrammar = xgrammar.GrammarCompiler(self.vocabulary.xgrammar_info, max_threads=COMPILE_THREADS,
                                                  cache_enabled=False)
        self._pool = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._in_flight: dict[str, concurrent.futures.Future[CompiledGrammar]] = {}
        self._over_budget: OrderedDict[str, None] = OrderedDict()

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        """The compiled grammar (the same object for a repeat while cached); GrammarRefused otherwise."""
        self._check(spec)
        request_key = grammar_key(spec.backend, spec.kind, spec.source, self.vocabulary.identity)
        with self._lock:
            cached = self._cache.get(request_key)
            if cached is not None:
                self._cache.move_to_end(request_key)
                return cached
            if request_key in self._over_budget:
                raise self._over_budget_refusal()
            future = self._in_flight.get(request_key)
            started = future is None
            if future is None:  # concurrent asks for one grammar share one compile
                future = self._pool.submit(self.compile_uncached, spec)
                self._in_flight[request_key] = future
        if started:  # outside the lock: a compile already done runs its callback here, at once
            future.add_done_callback(lambda done: self._finished(request_key, done))
        try:
            return self._store(request_key, future.result(timeout=self.time_budget_s))
        except concurrent.futures.TimeoutError:
            with self._lock:
                self._over_budget[request_key] = None
                while len(self._over_budget) > MAX_REMEMBERED_OVER_BUDGET:
                    self._over_budget.popitem(last=False)
            raise self._over_budget_refusal() from None

    def _finished(self, request_key: str, future: concurrent.futures.Future[CompiledGrammar]) -> None:
        with self._lock:
            self._in_flight.pop(request_key, None)
        if not future.cancelled() and future.exception() is None:
            self._store(request_key, future.result())

    def _store(self, request_key: str, grammar: CompiledGrammar) -> CompiledGrammar:
        """The cached object for the key (the first stored wins, so every caller gets the same one);
        an over-budget key's late result is dropped."""
        with self._lock:
            if request_key in self._over_budget:
                return grammar
            cached = self._cache.setdefault(request_key, grammar)
            self._cache.move_to_end(request_key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return cached

    def _over_budget_refusal(self) -> GrammarRefused:
        return GrammarRefused("", f"compiling the grammar took longer than its {self.time_budget_s:g} s budget")

    def _check(self, spec: StructuredOutput) -> None:
        if spec.kind not in STRUCTURED_KINDS:
            kinds = ", ".join(STRUCTURED_KINDS)
            raise GrammarRefused("", f"unknown structured-output kind {spec.kind!r} (one of {kinds})")
        if spec.backend != "auto" and spec.backend not in GRAMMAR_BACKENDS:
            raise GrammarRefused("", f"unknown grammar backend {spec.backend!r} (auto, {', '.join(GRAMMAR_BACKENDS)})")
        size = len(spec.source.encode())
        if size > self.max_source_bytes:
            raise GrammarRefused("", f"the {spec.kind} is {size} bytes, over the {self.max_source_bytes}-byte limit")
        if spec.kind != "json_object" and not spec.source.strip():
            raise GrammarRefused("", f"{spec.kind} needs a source")

    def backends_for(self, spec: StructuredOutput) -> list[str]:
        """The backends tried, in order."""
        if spec.backend != "auto":
            return [spec.backend]
        if spec.kind in _XGRAMMAR_ONLY_KINDS:
            return ["xgrammar"]
        if spec.kind == "grammar" and "::=" not in spec.source:
            return ["llguidance"]  # Lark: llguidance's own syntax
        return ["xgrammar", "llguidance"]

    def compile_uncached(self, spec: StructuredOutput) -> CompiledGrammar:
        """One compile, on the caller's thread, without budget or cache. When no backend can enforce
        it: the first refusal that names a path (the most precise), else the first backend's."""
        refusal: GrammarRefused | None = None
        for backend in self.backends_for(spec):
            try:
                if backend == "xgrammar":
                    payload = compile_xgrammar(self._xgrammar, spec.kind, spec.source)
                else:
                    payload = compile_llguidance(self.vocabulary, spec.kind, spec.source)
                if len(payload) > self.max_payload_bytes:
                    raise GrammarRefused("", f"the grammar {backend} compiled is {len(payload)} bytes, over the "
                                             f"{self.max_payload_bytes}-byte limit on what reaches the worker")
            except GrammarRefused as exc:
                if refusal is None or (exc.path and not refusal.path):
                    refusal = exc
                continue
            return CompiledGrammar(backend, grammar_key(backend, spec.kind, spec.source, self.vocabulary.identity),
                                   payload)
        assert refusal is not None
        raise refusal
