"""GrammarCompiler with the embedded model's tokenizer: every kind compiles, the backend is the
one that enforces it, unenforceable schema keywords are refused by path, and the size and time
budgets refuse without blocking past them."""

from __future__ import annotations

import json
import threading

import pytest

from vmesh.services.common.structured import GrammarCompiler, GrammarRefused
from vmesh.services.common.types import StructuredOutput

VOCAB_SIZE = 49152  # the embedded model's logits width
EOS = 2

SPECS = {
    "json_schema": StructuredOutput("json_schema", json.dumps(
        {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]})),
    "json_object": StructuredOutput("json_object"),
    "regex": StructuredOutput("regex", r"[a-c]{2}\d"),
    "choice": StructuredOutput("choice", json.dumps(["yes", "no"])),
    "grammar": StructuredOutput("grammar", 'root ::= "a" root | "b"'),
    "structural_tag": StructuredOutput("structural_tag", json.dumps(
        {"type": "structural_tag", "format": {"type": "const_string", "value": "done"}})),
}


@pytest.fixture(scope="module")
def compiler(embedded_model_dir) -> GrammarCompiler:
    return GrammarCompiler(embedded_model_dir / "tokenizer.json", VOCAB_SIZE, [EOS])


@pytest.mark.parametrize("kind", list(SPECS))
def test_every_kind_compiles_with_xgrammar_first(compiler: GrammarCompiler, kind: str) -> None:
    grammar = compiler.compile(SPECS[kind])
    assert grammar.backend == "xgrammar" and len(grammar.key) == 64 and grammar.payload


@pytest.mark.parametrize("kind", [k for k in SPECS if k != "structural_tag"])
def test_every_kind_but_structural_tag_compiles_with_llguidance(compiler: GrammarCompiler, kind: str) -> None:
    spec = SPECS[kind]
    grammar = compiler.compile(StructuredOutput(spec.kind, spec.source, "llguidance"))
    assert grammar.backend == "llguidance" and grammar.key != compiler.compile(spec).key


def test_structural_tag_named_for_llguidance_is_refused(compiler: GrammarCompiler) -> None:
    spec = SPECS["structural_tag"]
    with pytest.raises(GrammarRefused, match="xgrammar only"):
        compiler.compile(StructuredOutput(spec.kind, spec.source, "llguidance"))


def test_auto_falls_back_to_llguidance_only_for_what_xgrammar_lacks(compiler: GrammarCompiler) -> None:
    lark = StructuredOutput("grammar", 'start: "x" | "y"')
    assert compiler.compile(lark).backend == "llguidance"
    all_of = json.dumps({"allOf": [{"type": "integer"}, {"minimum": 3}]})
    assert compiler.compile(StructuredOutput("json_schema", all_of)).backend == "llguidance"
    with pytest.raises(GrammarRefused) as refused:
        compiler.compile(StructuredOutput("json_schema", all_of, "xgrammar"))
    assert refused.value.path == "allOf"


@pytest.mark.parametrize(("schema", "path"), [
    ({"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}, "properties.tags.uniqueItems"),
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "properties.a.not"),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"type": "array", "items": {"type": "string", "format": "iri"}}, "items.format"),
    ({"type": "array", "contains": {"const": 1}}, "contains"),
    ({"$defs": {"x": {"type": "object", "propertyNames": {"pattern": "^a"}}}, "$ref": "#/$defs/x"},
     "$defs.x.propertyNames"),
    ({"anyOf": [{"type": "string"}, {"type": "string", "contentEncoding": "base64"}]}, "anyOf.1.contentEncoding"),
    ({"type": "string", "x-unknown": 1}, "x-unknown"),
])
@pytest.mark.parametrize("backend", ["auto", "xgrammar", "llguidance"])
def test_unenforced_keywords_are_refused_naming_their_path(compiler: GrammarCompiler, schema: dict, path: str,
                                                            backend: str) -> None:
    with pytest.raises(GrammarRefused) as refused:
        compiler.compile(StructuredOutput("json_schema", json.dumps(schema), backend))
    assert refused.value.path == path
    assert path.rsplit(".", 1)[-1] in refused.value.detail or "format" in refused.value.detail


def test_enforced_keywords_and_annotations_compile(compiler: GrammarCompiler) -> None:
    schema = {"title": "t", "description": "d", "type": "object", "additionalProperties": False,
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9, "multipleOf": 3},
                             "s": {"type": "string", "pattern": "^[a-z]+$"}, "t": {"type": "string", "minLength": 1},
                             "e": {"type": "string", "format": "email"}, "u": {"type": "array", "uniqueItems": False,
                                                                                 "items": {"type": "integer"},
                                                                                 "minItems": 1, "maxItems": 2}},
              "required": ["n"]}
    assert compiler.compile(StructuredOutput("json_schema", json.dumps(schema))).backend == "xgrammar"


@pytest.mark.parametrize("shape", [{"pattern": "^[a-z]+$"}, {"format": "email"}])
def test_string_lengths_beside_a_pattern_or_format_go_to_llguidance(compiler: GrammarCompiler, shape: dict) -> None:
    # xgrammar drops the length bounds of a string that a pattern or format shapes.
    schema = json.dumps({"type": "object", "properties": {"s": {"type": "string", "maxLength": 8, **shape}},
                         "required": ["s"], "additionalProperties": False})
    assert compiler.compile(StructuredOutput("json_schema", schema)).backend == "llguidance"
    with pytest.raises(GrammarRefused) as refused:
        compiler.compile(StructuredOutput("json_schema", schema, "xgrammar"))
    assert refused.value.path == "properties.s.maxLength"


@pytest.mark.parametrize(("spec", "detail"), [
    (StructuredOutput("json_schema", "{not json"), "not valid JSON"),
    (StructuredOutput("choice", '["a", 1]'), "array of strings"),
    (StructuredOutput("regex", "("), "cannot compile"),
    (StructuredOutput("grammar", "root ::= undefined_rule"), 'Rule "undefined_rule" is not defined'),
    (StructuredOutput("nope", "x"), "unknown structured-output kind"),
    (StructuredOutput("regex", "a", "outlines"), "unknown grammar backend"),
])
def test_bad_sources_are_refused(compiler: GrammarCompiler, spec: StructuredOutput, detail: str) -> None:
    with pytest.raises(GrammarRefused, match=detail):
        compiler.compile(spec)


def test_a_source_over_the_size_limit_is_refused(embedded_model_dir) -> None:
    small = GrammarCompiler(embedded_model_dir / "tokenizer.json", VOCAB_SIZE, [EOS], max_source_bytes=16)
    with pytest.raises(GrammarRefused, match="17 bytes, over the 16-byte limit"):
        small.compile(StructuredOutput("regex", "a" * 17))
    assert small.compile(StructuredOutput("regex", "a" * 16)).backend == "xgrammar"


class _HeldCompiler(GrammarCompiler):
    """Compiles only once `release` is set: an over-budget compile, without timing."""

    release = threading.Event()
    calls = 0

    def compile_uncached(self, spec: StructuredOutput):
        type(self).calls += 1
        self.release.wait()
        return super().compile_uncached(spec)


def test_an_over_budget_compile_is_refused_and_remembered(embedded_model_dir) -> None:
    held = _HeldCompiler(embedded_model_dir / "tokenizer.json", VOCAB_SIZE, [EOS], time_budget_s=0.01)
    spec = StructuredOutput("regex", "[0-9]+")
    try:
        with pytest.raises(GrammarRefused, match="longer than its 0.01 s budget"):
            held.compile(spec)
        with pytest.raises(GrammarRefused, match="budget"):
            held.compile(spec)  # refused at once: no second compile
        assert _HeldCompiler.calls == 1
    finally:
        _HeldCompiler.release.set()


def test_a_cache_hit_returns_the_identical_object(compiler: GrammarCompiler) -> None:
    spec = StructuredOutput("regex", "[x-z]+")
    first = compiler.compile(spec)
    assert compiler.compile(StructuredOutput("regex", "[x-z]+")) is first


def test_the_cache_evicts_least_recently_used(embedded_model_dir) -> None:
    tiny = GrammarCompiler(embedded_model_dir / "tokenizer.json", VOCAB_SIZE, [EOS], cache_size=1)
    first = tiny.compile(StructuredOutput("regex", "a"))
    tiny.compile(StructuredOutput("regex", "b"))
    again = tiny.compile(StructuredOutput("regex", "a"))
    assert again == first and again is not first


def test_a_payload_over_its_limit_falls_back_to_llguidance_or_is_refused(embedded_model_dir) -> None:
    limited = GrammarCompiler(embedded_model_dir / "tokenizer.json", VOCAB_SIZE, [EOS], max_payload_bytes=2000)
    spec = SPECS["json_schema"]
    assert len(limited.compile(StructuredOutput(spec.kind, spec.source, "llguidance")).payload) <= 2000
    assert limited.compile(spec).backend == "llguidance"
    with pytest.raises(GrammarRefused, match="over the 2000-byte limit on what reaches the worker"):
        limited.compile(StructuredOutput(spec.kind, spec.source, "xgrammar"))
