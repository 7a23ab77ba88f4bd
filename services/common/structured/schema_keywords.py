"""Which JSON-schema keywords each backend enforces, and the check that refuses the rest.

A schema keyword a backend would silently ignore is refused (GrammarRefused naming its JSON
path, e.g. `properties.tags.uniqueItems`): no output may ignore part of its schema. Unknown
keywords are refused too. The sets below were found by compiling each keyword with the real
libraries (xgrammar 0.2.9, llguidance 1.9.1) and feeding each grammar a text that breaks it.

Accepted by both backends (enforced):
  type (a name or a list), properties, required, additionalProperties (false or a schema),
  items (a schema or false), prefixItems, enum, const, anyOf, $ref / $defs / definitions
  (recursion included), pattern, minLength, maxLength, minItems, maxItems, minimum, maximum,
  exclusiveMinimum, exclusiveMaximum, multipleOf, minProperties, maxProperties, format (the
  names in ENFORCED_FORMATS).
Only xgrammar: oneOf, enforced as anyOf (an output may match more than one branch where the
  branches overlap; llguidance refuses oneOf); uniqueItems: false (a no-op llguidance refuses).
Only llguidance (so "auto" compiles the schema with llguidance): allOf, patternProperties
  (xgrammar ignores allOf's constraints beyond the first branch and mis-enforces patternProperties),
  and minLength / maxLength on a string that also has a pattern or a format (xgrammar drops the
  length bounds there).
Annotations, accepted and without effect: title, description, default, examples, $schema, $id,
  $comment, deprecated, readOnly, writeOnly, discriminator (OpenAPI's; the oneOf branches it
  annotates enforce their tags themselves).
Refused everywhere (no backend enforces them): not, if / then / else, dependentRequired,
  dependentSchemas, uniqueItems: true, contains / minContains / maxContains, propertyNames,
  unevaluatedProperties, unevaluatedItems, contentEncoding, contentMediaType, additionalItems,
  formats outside ENFORCED_FORMATS (xgrammar ignores them: idn-email, iri, regex, binary, ...).
xgrammar compiles schemas in strict mode: an object without additionalProperties takes no other
keys and an array without items takes no items (a stricter output still validates).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
                         "readOnly", "writeOnly", "discriminator"})
_COMMON = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "enum", "const", "anyOf",
    "$ref", "$defs", "definitions", "pattern", "minLength", "maxLength", "minItems", "maxItems", "minimum",
    "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minProperties", "maxProperties", "format",
})
ENFORCED: dict[str, frozenset[str]] = {
    "xgrammar": _COMMON | {"oneOf", "uniqueItems"},  # uniqueItems: only false passes _refusal
    "llguidance": _COMMON | {"allOf", "patternProperties"},
}
# The string formats xgrammar enforces (others it ignores); llguidance enforces them too.
ENFORCED_FORMATS = frozenset({"date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
                              "uri-reference", "uri-template", "uuid", "json-pointer", "relative-json-pointer"})

_LENGTHS = ("minLength", "maxLength")
_ONE_SCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
               "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def _subschemas(schema: dict[str, Any], path: str) -> Iterator[tuple[Any, str]]:
    for key in _ONE_SCHEMA:
        if key in schema:
            yield schema[key], f"{path}{key}"
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                yield sub, f"{path}{key}.{name}"
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for index, sub in enumerate(schema[key]):
                yield sub, f"{path}{key}.{index}"


def _refusal(schema: dict[str, Any], key: str, backend: str) -> str:
    """Why `key` of `schema` cannot be enforced by `backend` ("" when it can)."""
    if key in ANNOTATIONS:
        return ""
    if key not in ENFORCED[backend]:
        return f"the JSON-schema keyword {key!r} is not supported by {backend}"
    if key == "uniqueItems" and schema[key] is not False:
        return f"the JSON-schema keyword {key!r} is not supported by {backend}"
    if key == "format" and schema[key] not in ENFORCED_FORMATS:
        return f"the string format {schema[key]!r} is not supported by {backend}"
    if backend == "xgrammar" and key in _LENGTHS and ("pattern" in schema or "format" in schema):
        # xgrammar 0.2.9 drops a string's length bounds when a pattern or format shapes it (it
        # logs so, and enforces neither bound): llguidance enforces both together.
        return f"{key!r} together with 'pattern' or 'format' is not enforced by {backend}"
    return ""


def first_unenforced(schema: Any, backend: str, path: str = "") -> tuple[str, str] | None:
    """The first keyword (path, detail) of `schema` that `backend` would not enforce, or None."""
    if not isinstance(schema, dict):
        return None  # true / false (or a malformed schema, which the backend refuses itself)
    for key in schema:
        detail = _refusal(schema, key, backend)
        if detail:
            return f"{path}{key}", detail
    for sub, sub_path in _subschemas(schema, path):
        found = first_unenforced(sub, backend, f"{sub_path}.")
        if found:
            return found
    return None
