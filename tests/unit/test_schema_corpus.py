"""The structured-output tests' JSON-schema corpus holds what it claims: valid Draft 2020-12
schemas, instances that pass and fail as labelled, tags that match the keywords used, and every
feature the tests promise covered; and assert_valid checks formats, not just syntax."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from jsonschema import Draft202012Validator

from tests.support.schema_corpus import (
    CHECKED_FORMATS,
    EXTRACTION_KINDS,
    FEATURES,
    KEYWORD_FEATURES,
    PURPOSE_FEATURES,
    assert_valid,
    load_corpus,
    schema_features,
    validation_errors,
)

CORPUS = load_corpus()
MIN_ENTRIES = 60
MIN_PER_FEATURE = 2


@pytest.mark.parametrize("case", CORPUS, ids=lambda case: case.name)
def test_entry_is_sound(case):
    Draft202012Validator.check_schema(case.schema)
    assert case.valid and case.invalid, f"{case.name}: needs a valid and an invalid instance"
    for instance in case.valid:
        assert validation_errors(case.schema, instance) == [], f"{case.name}: {instance!r} should validate"
        assert_valid(case.source, json.dumps(instance))
    for instance in case.invalid:
        assert validation_errors(case.schema, instance), f"{case.name}: {instance!r} should not validate"


@pytest.mark.parametrize("case", CORPUS, ids=lambda case: case.name)
def test_tags_match_the_schema(case):
    assert case.tags <= set(FEATURES), f"{case.name}: unknown tags {sorted(case.tags - set(FEATURES))}"
    assert case.tags & set(KEYWORD_FEATURES) == schema_features(case.schema), case.name


def test_size_and_unique_names():
    names = [case.name for case in CORPUS]
    assert len(names) >= MIN_ENTRIES
    assert [n for n, count in Counter(names).items() if count > 1] == []


def test_every_feature_is_covered():
    counts = Counter(tag for case in CORPUS for tag in case.tags)
    assert {f: counts[f] for f in FEATURES if counts[f] < MIN_PER_FEATURE} == {}


def _formats(node) -> set[str]:
    """Every "format" keyword anywhere in `node` (a property named "format" maps to a dict, not a string)."""
    if isinstance(node, list):
        return set().union(*map(_formats, node))
    if not isinstance(node, dict):
        return set()
    found = {node["format"]} if isinstance(node.get("format"), str) else set()
    return found.union(*map(_formats, node.values()))


def test_every_checked_format_is_covered():
    counts = Counter(f for case in CORPUS for f in _formats(case.schema))
    assert {f: counts[f] for f in CHECKED_FORMATS if counts[f] < MIN_PER_FEATURE} == {}
    assert set(counts) <= set(CHECKED_FORMATS), "a format the validator would not check"


def test_every_extraction_kind_has_entries():
    for kind in EXTRACTION_KINDS:
        named = [c.name for c in CORPUS if c.name.split("_")[0] == kind and set(PURPOSE_FEATURES) & c.tags]
        assert named, f"no extraction schema for {kind}"
    assert all("extraction" in c.tags for c in CORPUS if "tool-arguments" in c.tags)


@pytest.mark.parametrize(("fmt", "good", "bad"), [
    ("date", "2026-02-28", "2026-02-30"), ("time", "23:59:59Z", "23:59:59"),
    ("date-time", "2026-02-28T23:59:59+01:00", "2026-02-28T23:59:59"), ("email", "a@example.com", "example.com"),
    ("uuid", "6f1c2a4e-8b3d-4c1a-9e2f-0a1b2c3d4e5f", "6f1c2a4e8b3d"), ("ipv4", "192.0.2.1", "192.0.2.256"),
])
def test_formats_are_checked(fmt, good, bad):
    """Draft 2020-12's checkers: "time" needs an offset (draft 3's checker, the class-wide default,
    would take a bare "23:59:59" and refuse "23:59:59Z")."""
    schema = {"type": "string", "format": fmt}
    assert_valid(schema, json.dumps(good))
    with pytest.raises(AssertionError, match="does not validate"):
        assert_valid(schema, json.dumps(bad))


def test_assert_valid_shows_text_and_reason():
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 3}}, "required": ["n"]}
    assert assert_valid(schema, '{"n": 2}') == {"n": 2}
    with pytest.raises(AssertionError) as failed:
        assert_valid(json.dumps(schema), '{"n": 9}')
    assert "n: 9 is greater than the maximum of 3" in str(failed.value) and '{"n": 9}' in str(failed.value)
    with pytest.raises(AssertionError, match=r"not JSON .*\n\{\"n\": "):
        assert_valid(schema, '{"n": ')


def test_features_are_read_off_keywords():
    """schema_features on small schemas whose features are known, refs and recursion included."""
    kids = {"type": "array", "items": {"$ref": "#/$defs/n"}}
    tree = {"$defs": {"n": {"type": "object", "properties": {"kids": kids}}}, "$ref": "#/$defs/n"}
    assert schema_features(tree) == {"ref", "recursive-ref", "array-of-objects", "optional-properties"}
    point = {"type": "object", "properties": {"x": {"type": "number", "minimum": 0}}, "required": ["x"]}
    pair = {"$defs": {"p": point},
            "type": "object", "properties": {"a": {"$ref": "#/$defs/p"}, "b": {"$ref": "#/$defs/p"}},
            "required": ["a", "b"], "additionalProperties": False}
    assert schema_features(pair) == {"ref", "number-bounds", "additional-properties-false"}
    assert schema_features({"type": ["integer", "null"], "exclusiveMinimum": 0}) == {
        "type-union", "null", "integer-bounds", "exclusive-bounds"}


def test_the_date_format_is_rfc_3339_s_full_date():
    schema = {"type": "string", "format": "date"}
    valid = ["0000-01-01", "2024-02-29", "2000-02-29", "0000-02-29", "1999-12-31"]
    invalid = ["2023-02-29", "1900-02-29", "2023-13-01", "2023-00-10", "2023-04-31", "2023-1-01", "2023-01-01T00:00:00",
               "\uff12\uff10\uff12\uff13-01-01"]
    assert [s for s in valid if validation_errors(schema, s)] == []
    assert [s for s in invalid if not validation_errors(schema, s)] == []


def test_the_date_time_format_is_rfc_3339_s():
    schema = {"type": "string", "format": "date-time"}
    valid = ["0000-01-01T00:00:00Z", "2024-02-29T23:59:60Z", "2024-06-01t12:30:05.123+05:30",
             "1999-12-31T23:59:59-00:00", "2024-06-01T12:30:05z"]
    invalid = ["2024-06-01T24:00:00Z", "2024-06-01T12:60:00Z", "2024-06-01T12:00:61Z", "2024-06-01T12:00:00",
               "2024-06-01 12:00:00Z", "2023-02-29T00:00:00Z", "2024-06-01T12:00:00+24:00", "2024-06-01T12:00:00Z\n",
               "2024-06-01T12:00Z", "2024-06-01T12:00:00.Z"]
    assert [s for s in valid if validation_errors(schema, s)] == []
    assert [s for s in invalid if not validation_errors(schema, s)] == []
