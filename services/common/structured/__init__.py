"""Structured outputs: requests compiled into grammars (the frontend: GrammarCompiler) and
enforced token by token (the worker: load_matcher, apply_token_bitmask). Which JSON-schema
keywords are accepted, and why the rest are refused: schema_keywords."""

from vmesh.services.common.structured.backends import GrammarRefused
from vmesh.services.common.structured.compiler import GrammarCompiler, grammar_key
from vmesh.services.common.structured.matcher import (
    RowMatcher,
    allocate_token_bitmask,
    apply_token_bitmask,
    load_matcher,
)

__all__ = ["GrammarCompiler", "GrammarRefused", "RowMatcher", "allocate_token_bitmask", "apply_token_bitmask",
           "grammar_key", "load_matcher"]
