"""Structured outputs as the frontend takes them, and their compile step.

HTTP side (pure functions): OpenAI's `response_format`, vLLM's `structured_outputs` and a forced
tool choice each reduce to one StructuredOutput (at most one per request: two are a 400), with
the HTTP field it came from, so that a refusal found later names the field as the client wrote it.

Request path side: the GrammarCompiler the frontend builds for its model (from the model
directory's tokenizer.json, the model's vocabulary size and its EOS ids), and `compile_spec`,
which runs on a worker thread (the caller's executor) and turns any refusal into an
InvalidRequest naming `sampling.structured.source` (the detail starts with the schema path)."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import jsonschema
from jsonschema.validators import validator_for

from vmesh.services.common.admission import InvalidRequest
from vmesh.services.common.types import GRAMMAR_BACKENDS, CompiledGrammar, ModelLimits, StructuredOutput
from vmesh.services.frontend.errors import Code, RequestError

if TYPE_CHECKING:  # xgrammar, under the compiler, imports torch: loaded by the first constrained request
    from vmesh.services.common.structured import GrammarCompiler

logger = logging.getLogger(__name__)

# The HTTP response header naming the backend that enforced a constrained request's output.
BACKEND_HEADER = "vmesh-structured-output-backend"
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
# vLLM's structured_outputs keys -> StructuredOutput kinds ("json_object": true, the others: a source).
STRUCTURED_OUTPUTS_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                            "structural_tag": "structural_tag", "json_object": "json_object"}
# vmesh's own key (vLLM picks the backend per server, not per request).
BACKEND_KEY = "backend"
SOURCE_FIELD = "sampling.structured.source"


def _invalid(param: str, message: str) -> RequestError:
    return RequestError(Code.INVALID_ARGUMENT, f"{param}: {message}", param)


def _json_text(param: str, value: Any) -> str:
    """A schema (or structural tag) given as an object, or already as JSON text."""
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, bool)):
        return json.dumps(value, ensure_ascii=False)
    raise _invalid(param, "must be a JSON object (or its JSON text)")


def response_format_spec(value: dict[str, Any] | None) -> tuple[StructuredOutput, str] | None:
    """OpenAI's response_format as a StructuredOutput and the field its source sits in (None: text).
    `strict` is accepted either way: the schema is enforced in full, strict or not (as vLLM does)."""
    if value is None:
        return None
    kind = value.get("type", "text")
    if kind not in RESPONSE_FORMATS:
        raise _invalid("response_format.type", f"{kind!r} is not one of {', '.join(RESPONSE_FORMATS)}")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object"), "response_format"
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise _invalid("response_format.json_schema", "required: {'name', 'schema', 'strict', 'description'}")
    for name, kinds in (("name", str), ("description", str), ("strict", bool)):
        if spec.get(name) is not None and not isinstance(spec[name], kinds):
            raise _invalid(f"response_format.json_schema.{name}", f"must be a {kinds.__name__}")
    if "schema" not in spec:
        raise _invalid("response_format.json_schema.schema", "required")
    field = "response_format.json_schema.schema"
    return StructuredOutput("json_schema", _json_text(field, spec["schema"])), field


def structured_outputs_spec(value: dict[str, Any] | None) -> tuple[StructuredOutput, str] | None:
    """vLLM's structured_outputs ({"json" | "regex" | "choice" | "grammar" | "structural_tag" |
    "json_object": true}, exactly one; vmesh's "backend": auto, xgrammar or llguidance)."""
    if value is None:
        return None
    unknown = sorted(k for k in value if k not in STRUCTURED_OUTPUTS_KINDS and k != BACKEND_KEY
                     and value[k] not in (None, False))
    if unknown:
        raise _invalid(f"structured_outputs.{unknown[0]}", "not supported by vmesh")
    given = [k for k in STRUCTURED_OUTPUTS_KINDS if value.get(k) not in (None, False)]
    if len(given) != 1:
        kinds = ", ".join(STRUCTURED_OUTPUTS_KINDS)
        raise _invalid("structured_outputs", f"exactly one of {kinds} is required, got "
                                             f"{', '.join(given) or 'none'}")
    key = given[0]
    backend = value.get(BACKEND_KEY) or "auto"
    if backend != "auto" and backend not in GRAMMAR_BACKENDS:
        raise _invalid(f"structured_outputs.{BACKEND_KEY}", f"{backend!r} is not one of auto, "
                                                           f"{', '.join(GRAMMAR_BACKENDS)}")
    field = f"structured_outputs.{key}"
    source = value[key]
    if key == "json_object":
        if source is not True:
            raise _invalid(field, "must be true")
        source = ""
    elif key in ("json", "structural_tag"):
        source = _json_text(field, source)
    elif key == "choice":
        if not isinstance(source, list) or not source or not all(isinstance(c, str) for c in source):
            raise _invalid(field, "must be a non-empty list of strings")
        source = json.dumps(source, ensure_ascii=False)
    elif not isinstance(source, str):
        raise _invalid(field, "must be a string")
    return StructuredOutput(STRUCTURED_OUTPUTS_KINDS[key], source, backend), field


def request_spec(response_format: dict[str, Any] | None, structured_outputs: dict[str, Any] | None,
                 tool_schema: dict[str, Any] | None = None) -> tuple[StructuredOutput, str] | None:
    """The one structured output a request asks for (and its field), from whichever of its fields
    asks. Two at once are refused: an output cannot be held to two grammars. A forced tool
    choice's output is the calls, so it leaves no room for a response_format either."""
    asked = [s for s in (response_format_spec(response_format), structured_outputs_spec(structured_outputs)) if s]
    if tool_schema is not None:
        asked.append((StructuredOutput("json_schema", json.dumps(tool_schema, ensure_ascii=False)), "tools"))
    if len(asked) > 1:
        fields = [field.split(".")[0] for _, field in asked]
        if "tools" in fields:
            raise _invalid(fields[0], "cannot be combined with tool_choice 'required' or a named function, "
                                      "whose output is the tool calls")
        raise _invalid("structured_outputs", "only one of response_format and structured_outputs may "
                                             "constrain the output")
    return asked[0] if asked else None


def structured_aliases(field: str | None) -> dict[str, str]:
    """The gRPC names of the structured-output fields as this HTTP request spells them."""
    if field is None:
        return {}
    root = field.split(".")[0]
    return {"structured.source": field, "structured.kind": field, "structured": root,
            "structured.backend": f"{root}.{BACKEND_KEY}" if root == "structured_outputs" else root}


# --- compiling -------------------------------------------------------------------------------------


def check_schema(source: str) -> None:
    """A json_schema source that is JSON and a valid JSON schema (the backends would otherwise
    refuse it with their own, vaguer words)."""
    try:
        schema = json.loads(source)
    except ValueError as exc:
        raise InvalidRequest(SOURCE_FIELD, f"not valid JSON ({exc})") from exc
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequest(SOURCE_FIELD, "a JSON schema is an object (or true / false)")
    try:
        # true and false are schemas too, which jsonschema's stubs leave out.
        validator_for(schema).check_schema(schema)  # pyright: ignore[reportArgumentType]
    except jsonschema.SchemaError as exc:
        where = ".".join(str(p) for p in exc.path)
        raise InvalidRequest(SOURCE_FIELD, f"{where + ': ' if where else ''}not a valid JSON schema "
                                           f"({exc.message})") from exc


class LazyGrammarCompiler:
    """The model's GrammarCompiler, built by the first constrained request on its compile thread:
    xgrammar imports torch, which a frontend that never constrains an output does not load."""

    def __init__(self, build: Callable[[], GrammarCompiler | None]):
        self._build = build
        self._lock = threading.Lock()
        self._compiler: GrammarCompiler | None = None
        self._built = False

    def get(self) -> GrammarCompiler:
        with self._lock:
            if not self._built:
                self._compiler, self._built = self._build(), True
        if self._compiler is None:
            raise InvalidRequest("sampling.structured", "this model's output cannot be constrained (no tokenizer.json)")
        return self._compiler


SpecCompiler: TypeAlias = "GrammarCompiler | LazyGrammarCompiler"


def compile_spec(compiler: SpecCompiler, spec: StructuredOutput) -> CompiledGrammar:
    """The compiled grammar (blocking: call it on a worker thread), or an InvalidRequest naming
    sampling.structured.source, its detail prefixed with the path inside the source."""
    from vmesh.services.common.structured import GrammarRefused

    if isinstance(compiler, LazyGrammarCompiler):
        compiler = compiler.get()
    if spec.kind == "json_schema" and len(spec.source.encode()) <= compiler.max_source_bytes:
        check_schema(spec.source)
    try:
        return compiler.compile(spec)
    except GrammarRefused as exc:
        raise InvalidRequest(SOURCE_FIELD, str(exc)) from exc


def model_stop_token_ids(model_dir: Path | None, tokenizer: Any) -> list[int]:
    """The model's EOS ids, as the worker reads them (config.json's eos_token_id), else the
    tokenizer's EOS token."""
    if model_dir is not None:
        try:
            eos = json.loads((model_dir / "config.json").read_text()).get("eos_token_id")
        except (OSError, ValueError):
            eos = None
        if isinstance(eos, int):
            return [eos]
        if isinstance(eos, list) and all(isinstance(t, int) for t in eos):
            return list(eos)
    eos_token = getattr(tokenizer, "special_tokens", {}).get("eos_token") or getattr(tokenizer, "eos_token", None)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    token_id = backend.token_to_id(eos_token) if backend is not None and eos_token else None
    return [token_id] if token_id is not None else []


def build_compiler(tokenizer: Any, limits: ModelLimits, model_dir: Path | None) -> GrammarCompiler | None:
    """The model's grammar compiler, or None where its tokenizer has no tokenizer.json (a slow
    tokenizer): constrained requests are then refused."""
    path = model_dir / "tokenizer.json" if model_dir is not None else None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if path is not None and path.is_file():
        tokenizer_json: str | Path = path
    elif backend is not None and hasattr(backend, "to_str"):
        tokenizer_json = backend.to_str()
    else:
        return None
    from vmesh.services.common.structured import GrammarCompiler

    try:
        return GrammarCompiler(tokenizer_json, limits.vocab_size, model_stop_token_ids(model_dir, tokenizer))
    except Exception:  # a tokenizer neither backend reads: serve everything else
        logger.exception("cannot build the grammar compiler; structured outputs are refused")
        return None
