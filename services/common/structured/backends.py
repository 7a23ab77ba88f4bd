"""Each kind of structured output compiled by each backend: the payload a worker loads, or a
refusal. No caching or budgets here (GrammarCompiler adds them)."""

from __future__ import annotations

import json
import re
from typing import Any

import llguidance
import xgrammar

from vmesh.services.common.structured.schema_keywords import first_unenforced
from vmesh.services.common.structured.vocabulary import Vocabulary


class GrammarRefused(ValueError):
    """A structured-output request that cannot be served: unsupported keyword, bad syntax, or over
    budget. `path` names where (e.g. "properties.age.format" inside the schema; "" for the whole
    source), `detail` says why."""

    def __init__(self, path: str, detail: str):
        self.path = path
        self.detail = detail
        super().__init__(f"{path}: {detail}" if path else detail)


# JSON without optional whitespace (a model may otherwise emit whitespace without end), with
# the separators both backends then write.
_LLGUIDANCE_JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT_SCHEMA = '{"type": "object"}'


def is_ebnf(source: str) -> bool:
    """How "grammar" tells its two syntaxes apart: EBNF/GBNF defines rules with `::=`; Lark never does."""
    return "::=" in source


def parse_schema(source: str) -> Any:
    try:
        schema = json.loads(source)
    except json.JSONDecodeError as exc:
        raise GrammarRefused("", f"the JSON schema is not valid JSON: {exc}") from exc
    if not isinstance(schema, (dict, bool)):
        raise GrammarRefused("", "a JSON schema is an object (or true / false)")
    return schema


def parse_choice(source: str) -> list[str]:
    try:
        choices = json.loads(source)
    except json.JSONDecodeError as exc:
        raise GrammarRefused("", f"choice is not valid JSON: {exc}") from exc
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise GrammarRefused("", "choice is a non-empty JSON array of strings")
    return choices


def _ebnf_literal(text: str) -> str:
    # xgrammar's EBNF strings take JSON's escapes (\" \\ \n \uXXXX ...).
    return json.dumps(text, ensure_ascii=False)


def compile_xgrammar(compiler: xgrammar.GrammarCompiler, kind: str, source: str) -> bytes:
    """The serialized compiled grammar; GrammarRefused for what xgrammar cannot enforce."""
    try:
        if kind == "json_schema":
            found = first_unenforced(parse_schema(source), "xgrammar")
            if found:
                raise GrammarRefused(*found)
            compiled = compiler.compile_json_schema(source, any_whitespace=False, strict_mode=True)
        elif kind == "json_object":
            compiled = compiler.compile_json_schema(ANY_OBJECT_SCHEMA, any_whitespace=False, strict_mode=False)
        elif kind == "regex":
            compiled = compiler.compile_regex(source)
        elif kind == "choice":
            compiled = compiler.compile_grammar("root ::= " + " | ".join(map(_ebnf_literal, parse_choice(source))))
        elif kind == "grammar":
            compiled = compiler.compile_grammar(source) if is_ebnf(source) else compiler.compile_lark(source)
        elif kind == "structural_tag":
            compiled = compiler.compile_structural_tag(source)
        else:
            raise GrammarRefused("", f"unknown structured-output kind {kind!r}")
    except GrammarRefused:
        raise
    except Exception as exc:  # xgrammar raises RuntimeError, ValueError and its own errors for a bad source
        raise GrammarRefused("", f"xgrammar cannot compile this {kind}: {_first_line(exc)}") from exc
    return compiled.serialize_json().encode()


def _llguidance_grammar(kind: str, source: str) -> str:
    if kind == "json_schema":
        found = first_unenforced(parse_schema(source), "llguidance")
        if found:
            raise GrammarRefused(*found)
        return llguidance.LLMatcher.grammar_from_json_schema(source, overrides=_LLGUIDANCE_JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(ANY_OBJECT_SCHEMA, overrides=_LLGUIDANCE_JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(source)
    if kind == "choice":
        parse_choice(source)
        return llguidance.grammar_from("choice", source)
    if kind == "grammar":
        return llguidance.grammar_from("gbnf" if is_ebnf(source) else "lark", source)
    if kind == "structural_tag":
        raise GrammarRefused("", "structural_tag is compiled by xgrammar only")
    raise GrammarRefused("", f"unknown structured-output kind {kind!r}")


def compile_llguidance(vocabulary: Vocabulary, kind: str, source: str) -> bytes:
    """llguidance's grammar JSON, checked against the tokenizer (llguidance compiles it again,
    lazily, in each matcher); GrammarRefused for what llguidance cannot enforce."""
    try:
        grammar = _llguidance_grammar(kind, source)
        matcher = llguidance.LLMatcher(vocabulary.llguidance_tokenizer, grammar, log_level=0)
    except GrammarRefused:
        raise
    except Exception as exc:
        raise GrammarRefused("", f"llguidance cannot compile this {kind}: {_first_line(exc)}") from exc
    if matcher.is_error():  # e.g. "Unimplemented keys: [...]", an unknown format, a Lark syntax error
        raise GrammarRefused("", f"llguidance cannot compile this {kind}: {_first_line(matcher.get_error())}")
    return grammar.encode()


# xgrammar prefixes its C++ errors with "[hh:mm:ss] /path/file.cc:line: ".
_SOURCE_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def _first_line(error: object) -> str:
    lines = str(error).strip().splitlines()
    return _SOURCE_LOCATION.sub("", lines[0]) if lines else type(error).__name__
