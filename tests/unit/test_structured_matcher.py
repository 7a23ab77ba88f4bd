"""The worker's matchers over grammars compiled with the embedded model's tokenizer, for both
backends: random walks through the allowed tokens decode to text that validates, stop tokens
are allowed only where the grammar accepts, replay and rollback restore a matcher, and the
bitmask masks exactly the disallowed logits; a tokenizer.json is read once while it is unchanged."""

from __future__ import annotations

import json
import os
import random
import re
import shutil

import jsonschema
import pytest
import tokenizers
import torch

from vmesh.services.common.structured import (
    GrammarCompiler,
    allocate_token_bitmask,
    apply_token_bitmask,
    load_matcher,
    vocabulary,
)
from vmesh.services.common.types import StructuredOutput

VOCAB_SIZE = 49152
EOS = 2
MAX_WALK = 200
BACKENDS = ["xgrammar", "llguidance"]

SCHEMAS = [
    {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
     "properties": {"name": {"type": "string", "maxLength": 6},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}},
    {"anyOf": [{"type": "boolean"}, {"type": "object", "properties": {"k": {"const": "v"}}, "required": ["k"],
                                     "additionalProperties": False}]},
    {"type": "array", "minItems": 1, "maxItems": 2, "items": {"type": "string", "pattern": "^[xy]{1,3}$"}},
    {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5}},
                         "required": ["x"], "additionalProperties": False}},
     "type": "object", "properties": {"p": {"$ref": "#/$defs/point"}, "ok": {"type": "boolean"}},
     "required": ["p", "ok"], "additionalProperties": False},
]
CHOICES = ["yes", "no", 'a"b\\c', "line\nbreak", "é"]
REGEX = r"[a-c]{2}\d(-x)?"


@pytest.fixture(scope="module")
def tokenizer_json(embedded_model_dir):
    return embedded_model_dir / "tokenizer.json"


@pytest.fixture(scope="module")
def compiler(tokenizer_json) -> GrammarCompiler:
    return GrammarCompiler(tokenizer_json, VOCAB_SIZE, [EOS])


@pytest.fixture(scope="module")
def tokenizer(tokenizer_json) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(tokenizer_json))


def allowed_ids(bitmask_row: torch.Tensor) -> list[int]:
    bits = (bitmask_row.unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:VOCAB_SIZE].nonzero().flatten().tolist()


def random_walk(compiler, tokenizer_json, spec: StructuredOutput, seed: int) -> tuple[list[int], bool]:
    """Tokens picked at random among the allowed ones until the matcher terminates (or MAX_WALK)."""
    grammar = compiler.compile(spec)
    assert grammar.backend == spec.backend
    matcher = load_matcher(grammar, tokenizer_json, VOCAB_SIZE, [EOS])
    bitmask = allocate_token_bitmask(1, VOCAB_SIZE)
    rng = random.Random(seed)
    tokens: list[int] = []
    for _ in range(MAX_WALK):
        matcher.fill_bitmask(bitmask, 0)
        allowed = allowed_ids(bitmask[0])
        assert allowed, "a matcher that has not terminated allows some token"
        token = EOS if EOS in allowed and rng.random() < 0.5 else rng.choice(allowed)
        assert matcher.accept(token)
        if matcher.is_terminated():
            assert token == EOS
            return tokens, True
        tokens.append(token)
    return tokens, False


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("schema_index", range(len(SCHEMAS)))
def test_random_walks_through_a_schema_validate(compiler, tokenizer_json, tokenizer, backend: str,
                                                schema_index: int) -> None:
    schema = SCHEMAS[schema_index]
    for seed in range(4):
        tokens, terminated = random_walk(compiler, tokenizer_json,
                                         StructuredOutput("json_schema", json.dumps(schema), backend), seed)
        assert terminated
        jsonschema.validate(json.loads(tokenizer.decode(tokens)), schema)


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_walks_through_a_regex_match_it(compiler, tokenizer_json, tokenizer, backend: str) -> None:
    for seed in range(6):
        tokens, terminated = random_walk(compiler, tokenizer_json, StructuredOutput("regex", REGEX, backend), seed)
        assert terminated and re.fullmatch(REGEX, tokenizer.decode(tokens))


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_walks_through_a_choice_give_one_of_them(compiler, tokenizer_json, tokenizer, backend: str) -> None:
    for seed in range(8):
        tokens, terminated = random_walk(compiler, tokenizer_json,
                                         StructuredOutput("choice", json.dumps(CHOICES), backend), seed)
        assert terminated and tokenizer.decode(tokens) in CHOICES


@pytest.mark.parametrize(("backend", "source"), [
    ("xgrammar", 'root ::= "(" [0-9] [0-9]? ")" | "none"'),
    ("llguidance", 'root ::= "(" [0-9] [0-9]? ")" | "none"'),
    ("llguidance", 'start: "(" DIGITS ")" | "none"\nDIGITS: /[0-9]{1,2}/'),
    ("xgrammar", 'start: "(" DIGITS ")" | "none"\nDIGITS: /[0-9]{1,2}/'),
])
def test_random_walks_through_a_grammar_match_it(compiler, tokenizer_json, tokenizer, backend: str,
                                                 source: str) -> None:
    for seed in range(6):
        tokens, terminated = random_walk(compiler, tokenizer_json, StructuredOutput("grammar", source, backend), seed)
        assert terminated and re.fullmatch(r"\([0-9]{1,2}\)|none", tokenizer.decode(tokens))


@pytest.mark.parametrize("backend", BACKENDS)
def test_json_object_walks_stay_a_json_object_prefix(compiler, tokenizer_json, tokenizer, backend: str) -> None:
    tokens, terminated = random_walk(compiler, tokenizer_json, StructuredOutput("json_object", "", backend), 0)
    text = tokenizer.decode(tokens)
    assert text.startswith("{")
    if terminated:
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("backend", BACKENDS)
def test_eos_is_allowed_only_where_the_grammar_accepts(compiler, tokenizer_json, tokenizer, backend: str) -> None:
    grammar = compiler.compile(StructuredOutput("regex", "ab", backend))
    matcher = load_matcher(grammar, tokenizer_json, VOCAB_SIZE, [EOS])
    bitmask = allocate_token_bitmask(1, VOCAB_SIZE)
    matcher.fill_bitmask(bitmask, 0)
    assert EOS not in allowed_ids(bitmask[0])
    assert not matcher.accept(EOS) and not matcher.is_terminated()


@pytest.mark.parametrize("backend", BACKENDS)
def test_replay_and_rollback_restore_the_mask(compiler, tokenizer_json, tokenizer, backend: str) -> None:
    spec = StructuredOutput("json_schema", json.dumps(SCHEMAS[0]), backend)
    prefix = tokenizer.encode('{"name": "bo', add_special_tokens=False).ids
    first, replayed, rolled = (load_matcher(compiler.compile(spec), tokenizer_json, VOCAB_SIZE, [EOS])
                               for _ in range(3))
    masks = allocate_token_bitmask(3, VOCAB_SIZE)
    for token in prefix:
        assert first.accept(token) and replayed.accept(token) and rolled.accept(token)
    extra = tokenizer.encode("b", add_special_tokens=False).ids
    assert all(rolled.accept(t) for t in extra)
    rolled.rollback(len(extra))
    for row, matcher in enumerate((first, replayed, rolled)):
        matcher.fill_bitmask(masks, row)
    assert torch.equal(masks[0], masks[1]) and torch.equal(masks[0], masks[2])
    assert EOS not in allowed_ids(masks[0]) and len(allowed_ids(masks[0])) < VOCAB_SIZE  # mid-object


def test_apply_masks_exactly_the_disallowed_logits(compiler, tokenizer_json) -> None:
    matcher = load_matcher(compiler.compile(StructuredOutput("regex", "[0-9]+")), tokenizer_json, VOCAB_SIZE, [EOS])
    bitmask = allocate_token_bitmask(3, VOCAB_SIZE)
    matcher.fill_bitmask(bitmask, 1)
    logits = torch.randn(3, VOCAB_SIZE)
    before = logits.clone()
    apply_token_bitmask(logits, bitmask, rows=[1])
    allowed = allowed_ids(bitmask[1])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert torch.equal(logits[1, allowed], before[1, allowed])
    assert torch.isinf(logits[1]).sum() == VOCAB_SIZE - len(allowed) and 0 < len(allowed) < 100


def test_string_lengths_beside_a_pattern_hold_under_auto(compiler, tokenizer_json, tokenizer) -> None:
    # xgrammar would drop these bounds; "auto" compiles them with llguidance, which keeps them.
    schema = {"type": "string", "pattern": "^[a-z]+$", "minLength": 2, "maxLength": 3}
    grammar = compiler.compile(StructuredOutput("json_schema", json.dumps(schema)))
    for seed in range(8):
        tokens, terminated = random_walk(compiler, tokenizer_json,
                                         StructuredOutput("json_schema", json.dumps(schema), grammar.backend), seed)
        assert terminated
        jsonschema.validate(json.loads(tokenizer.decode(tokens)), schema)


def test_a_tokenizer_file_is_read_again_only_once_it_changes(tokenizer_json, tmp_path, monkeypatch) -> None:
    # The worker asks for the vocabulary with every constrained request: reading and hashing the
    # file each time cost 20-60 ms of its step loop per request.
    copy = tmp_path / "tokenizer.json"
    shutil.copy(tokenizer_json, copy)
    reads: list[object] = []
    read = vocabulary.tokenizer_json_text
    monkeypatch.setattr(vocabulary, "tokenizer_json_text", lambda source: reads.append(source) or read(source))
    first = vocabulary.shared_vocabulary(copy, VOCAB_SIZE, [EOS])
    assert vocabulary.shared_vocabulary(str(copy), VOCAB_SIZE, [EOS]) is first
    assert len(reads) == 1
    mtime = copy.stat().st_mtime_ns + 10**9
    os.utime(copy, ns=(mtime, mtime))
    assert vocabulary.shared_vocabulary(copy, VOCAB_SIZE, [EOS]) is first  # the same text: the same vocabulary
    assert len(reads) == 2
