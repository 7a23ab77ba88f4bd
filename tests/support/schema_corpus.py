"""The JSON-schema corpus of the structured-output tests (tests/data/json_schemas/), and the
check every generated output must pass: it parses as JSON and validates against its schema
(Draft 2020-12, with the formats grammar engines generate checked, not just annotated).

Each corpus file is a JSON list of entries: {"name", "tags", "schema", "valid", "invalid"}.
Tags name the features an entry exercises; the keyword features (KEYWORD_FEATURES) are also
derived from the schema itself (schema_features), and the corpus's own test holds the two equal,
so a count per tag is a count of schemas that really use the feature."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator, FormatChecker

CORPUS_DIR = Path(__file__).resolve().parents[1] / "data" / "json_schemas"

# The string formats grammar engines commonly generate. jsonschema checks "date-time" and "time"
# only with rfc3339-validator installed; without it they would pass unchecked, so building the
# checker refuses.
CHECKED_FORMATS = ("date", "time", "date-time", "email", "uuid", "ipv4")

# Features read off the schema's keywords (see schema_features).
KEYWORD_FEATURES = (
    "nested-objects", "deep-nesting", "array-bounds", "array-of-objects", "enum", "const", "anyOf", "oneOf",
    "ref", "recursive-ref", "pattern", "format", "string-length", "number-bounds", "integer-bounds",
    "exclusive-bounds", "additional-properties-false", "optional-properties", "boolean", "null", "type-union",
)
# Features a reader judges: what the schema is for.
PURPOSE_FEATURES = ("extraction", "tool-arguments")
FEATURES = KEYWORD_FEATURES + PURPOSE_FEATURES
# Each of these has entries named after it (an entry's name starts with the word).
EXTRACTION_KINDS = ("invoice", "person", "address", "event", "product", "tool")

DEEP_NESTING_LEVELS = 4  # objects within objects, the root counted


@dataclass(frozen=True)
class SchemaCase:
    """One corpus entry: a schema with instances known to pass and to fail it."""

    name: str
    schema: dict[str, Any]
    valid: tuple[Any, ...]
    invalid: tuple[Any, ...]
    tags: frozenset[str]
    file: str

    @property
    def source(self) -> str:
        """The schema as JSON text, as a request carries it."""
        return json.dumps(self.schema)


def load_corpus(directory: Path = CORPUS_DIR) -> list[SchemaCase]:
    """Every entry of every corpus file, in file then list order."""
    cases = []
    for path in sorted(directory.glob("*.json")):
        for i, entry in enumerate(json.loads(path.read_text())):
            unknown = set(entry) - {"name", "tags", "schema", "valid", "invalid"}
            if unknown:
                raise ValueError(f"{path.name}[{i}]: unknown keys {sorted(unknown)}")
            cases.append(SchemaCase(name=entry["name"], schema=entry["schema"], valid=tuple(entry["valid"]),
                                    invalid=tuple(entry["invalid"]), tags=frozenset(entry["tags"]),
                                    file=path.name))
    return cases


def corpus_by_name(directory: Path = CORPUS_DIR) -> dict[str, SchemaCase]:
    return {case.name: case for case in load_corpus(directory)}


def format_checker() -> FormatChecker:
    """Draft 2020-12's checkers for CHECKED_FORMATS. (FormatChecker(formats=...) would take them from
    the class-wide table, where "time" is draft 3's: a bare "%H:%M:%S", no offset.)"""
    draft_checkers = Draft202012Validator.FORMAT_CHECKER.checkers
    missing = [name for name in CHECKED_FORMATS if name not in draft_checkers]
    if missing:
        raise RuntimeError(f"jsonschema cannot check the formats {missing}: install rfc3339-validator "
                           "(vmesh's dev extra has it)")
    checker = FormatChecker(formats=())
    checker.checkers = {name: draft_checkers[name] for name in CHECKED_FORMATS}
    checker.checks("date")(is_full_date)
    checker.checks("date-time")(is_date_time)
    return checker


def is_full_date(instance: object) -> bool:
    """RFC 3339's full-date, which JSON Schema's "date" names: four digits of year (0000 too),
    a month, and a day that month has. jsonschema's own check (`date.fromisoformat`) refuses the
    year 0000, which the RFC's grammar allows and grammar engines generate."""
    if not isinstance(instance, str):
        return True
    match = re.fullmatch(r"([0-9]{4})-([0-9]{2})-([0-9]{2})", instance)
    if match is None:
        return False
    year, month, day = map(int, match.groups())
    leap = year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
    days = (31, 29 if leap else 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)
    return 1 <= month <= 12 and 1 <= day <= days[month - 1]


_PARTIAL_TIME_AND_OFFSET = re.compile(
    r"([0-9]{2}):([0-9]{2}):([0-9]{2})(?:\.[0-9]+)?(?:[Zz]|[+-]([0-9]{2}):([0-9]{2}))")


def is_date_time(instance: object) -> bool:
    """RFC 3339's date-time: a full-date (is_full_date), "T" (or "t"), hours 00-23, minutes
    00-59, seconds 00-60 (a leap second), an optional fraction and an offset ("Z" or +/-hh:mm).
    rfc3339-validator, jsonschema's check, refuses the year 0000 and the leap second, and lets a
    trailing newline through."""
    if not isinstance(instance, str):
        return True
    date, separator, time = instance[:10], instance[10:11], instance[11:]
    match = _PARTIAL_TIME_AND_OFFSET.fullmatch(time)
    if separator not in ("T", "t") or match is None or not is_full_date(date):
        return False
    hour, minute, second, offset_hour, offset_minute = (int(g) if g else 0 for g in match.groups())
    return hour <= 23 and minute <= 59 and second <= 60 and offset_hour <= 23 and offset_minute <= 59


def validator(schema: Mapping[str, Any] | str) -> Draft202012Validator:
    """A Draft 2020-12 validator of `schema` (a dict or its JSON text) that checks CHECKED_FORMATS."""
    parsed = json.loads(schema) if isinstance(schema, str) else schema
    return Draft202012Validator(parsed, format_checker=format_checker())


def validation_errors(schema: Mapping[str, Any] | str, instance: Any) -> list[str]:
    """Each way `instance` fails `schema`, as "path: message"; empty when it validates."""
    return [f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
            for e in sorted(validator(schema).iter_errors(instance), key=lambda e: list(map(str, e.path)))]


def assert_valid(schema: Mapping[str, Any] | str, text: str) -> Any:
    """The parsed value of `text`, which must be JSON that validates against `schema`; otherwise an
    AssertionError showing the text and why it fails."""
    try:
        instance = json.loads(text)
    except json.JSONDecodeError as exc:
        raise AssertionError(f"not JSON ({exc}):\n{text}") from None
    errors = validation_errors(schema, instance)
    if errors:
        raise AssertionError("does not validate against its schema:\n" + "\n".join(errors) + f"\ntext:\n{text}")
    return instance


def _types(schema: Mapping[str, Any]) -> set[str]:
    declared = schema.get("type", ())
    return {declared} if isinstance(declared, str) else set(declared)


def _subschemas(schema: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """The schemas directly inside `schema` (not through $ref)."""
    for key in ("properties", "$defs"):
        yield from schema.get(key, {}).values()
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            yield schema[key]
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        yield from schema.get(key, ())


def _resolve(root: Mapping[str, Any], ref: str) -> Mapping[str, Any]:
    """A local reference ("#" or "#/$defs/name/..."), the only kind the corpus uses."""
    node: Any = root
    for part in ref.removeprefix("#").strip("/").split("/") if ref != "#" else ():
        node = node[part]
    return node


def _object_depth(root: Mapping[str, Any], schema: Mapping[str, Any], seen: frozenset[str]) -> int:
    """How many objects deep an instance of `schema` nests (through refs, once per cycle)."""
    if "$ref" in schema:
        ref = schema["$ref"]
        return 0 if ref in seen else _object_depth(root, _resolve(root, ref), seen | {ref})
    inner = [_object_depth(root, sub, seen) for sub in _inner_values(schema)]
    own = 1 if "object" in _types(schema) or "properties" in schema else 0
    return own + max(inner, default=0)


def _inner_values(schema: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """The subschemas an instance's values follow (not $defs, which only name them)."""
    yield from schema.get("properties", {}).values()
    if isinstance(schema.get("items"), dict):
        yield schema["items"]
    for key in ("anyOf", "oneOf", "allOf"):
        yield from schema.get(key, ())


def _refs(schema: Mapping[str, Any]) -> set[str]:
    found = {schema["$ref"]} if "$ref" in schema else set()
    for sub in _subschemas(schema):
        found |= _refs(sub)
    return found


def _is_recursive(root: Mapping[str, Any]) -> bool:
    """Whether some reference leads, through references, back into itself."""
    def reaches(ref: str, target: str, seen: set[str]) -> bool:
        for inner in _refs(_resolve(root, ref)):
            if inner == target or target.startswith(inner + "/") or inner == "#":
                return True
            if inner not in seen and reaches(inner, target, seen | {inner}):
                return True
        return False

    return any(reaches(ref, ref, {ref}) for ref in _refs(root))


def _walk(schema: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    yield schema
    for sub in _subschemas(schema):
        yield from _walk(sub)


def _item_is_object(root: Mapping[str, Any], items: Mapping[str, Any]) -> bool:
    target = _resolve(root, items["$ref"]) if "$ref" in items else items
    return "object" in _types(target) or "properties" in target


def schema_features(schema: Mapping[str, Any]) -> set[str]:
    """The KEYWORD_FEATURES `schema` uses."""
    found: set[str] = set()
    for node in _walk(schema):
        types = _types(node)
        has = set(node)
        found |= {feature for feature, keys in (
            ("array-bounds", {"minItems", "maxItems"}), ("enum", {"enum"}), ("const", {"const"}),
            ("anyOf", {"anyOf"}), ("oneOf", {"oneOf"}), ("ref", {"$ref"}), ("pattern", {"pattern"}),
            ("format", {"format"}), ("string-length", {"minLength", "maxLength"}),
            ("exclusive-bounds", {"exclusiveMinimum", "exclusiveMaximum"})) if has & keys}
        if has & {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}:
            found.add("integer-bounds" if "integer" in types else "number-bounds")
        if node.get("additionalProperties") is False:
            found.add("additional-properties-false")
        if set(node.get("properties", {})) - set(node.get("required", ())):
            found.add("optional-properties")
        found |= {"boolean", "null"} & types
        if len(types) > 1:
            found.add("type-union")
        if isinstance(node.get("items"), dict) and _item_is_object(schema, node["items"]):
            found.add("array-of-objects")
        if any(("object" in _types(sub) or "properties" in sub) for sub in node.get("properties", {}).values()):
            found.add("nested-objects")
    if _is_recursive(schema):
        found.add("recursive-ref")
    if _object_depth(schema, schema, frozenset()) >= DEEP_NESTING_LEVELS:
        found.add("deep-nesting")
    return found
