"""What makes a request servable by a model: one set of rules, applied at every door.

The frontend applies them to what clients send; the scheduler applies them again to every
SubmitRequest, whoever sent it, because one bad request that reached the worker would fail the
step it shares with every other request; the in-process engine applies them to what a library
caller adds. A refusal is an InvalidRequest that names the offending field as the gRPC API
spells it (`prompt`, `token_ids`, `sampling.top_p`, ...), so that every API can point at it
in its own terms. Protobuf-free: each door decodes its own messages first."""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

from vmesh.services.common.types import (
    FLOAT_SAMPLING_FIELDS,
    GRAMMAR_BACKENDS,
    MAX_LOGPROBS,
    STRUCTURED_KINDS,
    ModelLimits,
    SamplingParams,
)

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
# Each stop id is checked against every sampled token; a request with a million of them slowed
# its step neighbours ~14x. vLLM's largest practical lists (multi-EOS models) are a handful.
MAX_STOP_TOKEN_IDS = 256

class InvalidRequest(ValueError):
    """A request that cannot be served. `field`: the offending field, as the gRPC API names it;
    the message is `"{field}: {detail}"`."""

    def __init__(self, field: str, detail: str):
        super().__init__(f"{field}: {detail}")
        self.field = field
        self.detail = detail


def admit(prompt_token_ids: Sequence[int], params: SamplingParams, limits: ModelLimits,
          resumed_output_token_ids: Sequence[int] = ()) -> None:
    """Raise InvalidRequest unless the model can serve this request: its prompt, its sampling
    settings (decoded, defaults filled) and, for a request failing over, the outputs it has."""
    check_prompt_length(len(prompt_token_ids), limits)
    _check_vocabulary("token_ids", prompt_token_ids, limits)
    _check_sampling(params, len(prompt_token_ids), limits)
    if resumed_output_token_ids:
        _check_resumed(resumed_output_token_ids, params, limits)


def check_prompt_length(num_tokens: int, limits: ModelLimits) -> None:
    """The prompt's length alone: O(1), so a door may apply it before it copies the ids."""
    if num_tokens == 0:
        raise InvalidRequest("prompt", "empty")
    if num_tokens >= limits.max_model_len:
        raise InvalidRequest("prompt", f"{num_tokens} tokens; the context holds {limits.max_model_len}, "
                                       "so the prompt must be shorter")


def check_model(requested: str, limits: ModelLimits) -> None:
    """A request that names a model (empty: the one served) must name the served one."""
    if requested and requested != limits.name:
        raise InvalidRequest("model", f"unknown model {requested!r} (this server serves {limits.name!r})")


def _check_vocabulary(field: str, token_ids: Sequence[int], limits: ModelLimits) -> None:
    bad = next((t for t in token_ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise InvalidRequest(field, f"{bad} is outside the vocabulary [0, {limits.vocab_size})")


def _check_resumed(resumed_output_token_ids: Sequence[int], params: SamplingParams, limits: ModelLimits) -> None:
    """The outputs a failing-over request already has: tokens of the vocabulary, fewer than its budget."""
    n = len(resumed_output_token_ids)
    if n >= params.max_tokens:
        raise InvalidRequest("resumed_output_token_ids", f"{n} tokens leave nothing of max_tokens={params.max_tokens}")
    _check_vocabulary("resumed_output_token_ids", resumed_output_token_ids, limits)


def _check_sampling(params: SamplingParams, num_prompt_tokens: int, limits: ModelLimits) -> None:
    _check_ranges(params)
    room = limits.max_model_len - num_prompt_tokens
    if params.max_tokens > room:
        raise InvalidRequest("sampling.max_tokens", f"{params.max_tokens} past the context ({num_prompt_tokens} "
                                                    f"prompt tokens + {params.max_tokens} > {limits.max_model_len})")
    if len(params.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest("sampling.stop", f"{len(params.stop)} stop strings; at most {MAX_STOP_STRINGS}")
    if any(not s or len(s) > MAX_STOP_STRING_CHARS for s in params.stop):
        raise InvalidRequest("sampling.stop", f"each stop string needs 1 to {MAX_STOP_STRING_CHARS} characters")
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest("sampling.stop_token_ids", f"{len(params.stop_token_ids)} ids; "
                                                        f"at most {MAX_STOP_TOKEN_IDS}")
    _check_vocabulary("sampling.stop_token_ids", params.stop_token_ids, limits)
    _check_structured(params)


def _check_structured(params: SamplingParams) -> None:
    """A structured output of a known kind and backend (the wire reads an unspecified kind as "");
    a compiled grammar from a backend the worker has. Whether the source compiles is the
    frontend's GrammarCompiler's to say."""
    if params.structured is not None:
        if params.structured.kind not in STRUCTURED_KINDS:
            raise InvalidRequest("sampling.structured.kind",
                                 f"unspecified or unknown; one of {', '.join(STRUCTURED_KINDS)}")
        if params.structured.backend != "auto" and params.structured.backend not in GRAMMAR_BACKENDS:
            raise InvalidRequest("sampling.structured.backend", f"{params.structured.backend!r} is not one of auto, "
                                                                f"{', '.join(GRAMMAR_BACKENDS)}")
    if params.grammar is not None and params.grammar.backend not in GRAMMAR_BACKENDS:
        raise InvalidRequest("sampling.grammar.backend", f"{params.grammar.backend!r} is not one of "
                                                         f"{', '.join(GRAMMAR_BACKENDS)}")


def _check_ranges(params: SamplingParams) -> None:
    """Each setting within its own range (NaN and infinities refused), the first one outside named."""
    for name in FLOAT_SAMPLING_FIELDS:
        if not math.isfinite(getattr(params, name)):
            raise InvalidRequest(f"sampling.{name}", f"must be a finite number, got {getattr(params, name)}")
    ranges = [
        ("temperature", params.temperature >= 0, ">= 0"),
        ("top_p", 0.0 < params.top_p <= 1.0, "in (0, 1]"),
        ("top_k", params.top_k >= -1, "-1 (disabled) or >= 0"),
        ("min_p", 0.0 <= params.min_p <= 1.0, "in [0, 1]"),
        ("repetition_penalty", params.repetition_penalty > 0, "> 0"),
        ("presence_penalty", -2.0 <= params.presence_penalty <= 2.0, "in [-2, 2]"),
        ("frequency_penalty", -2.0 <= params.frequency_penalty <= 2.0, "in [-2, 2]"),
        ("max_tokens", params.max_tokens >= 1, ">= 1"),
        ("min_tokens", 0 <= params.min_tokens <= params.max_tokens, "in [0, max_tokens]"),
        ("logprobs", params.logprobs is None or 0 <= params.logprobs <= MAX_LOGPROBS, f"in [0, {MAX_LOGPROBS}]"),
        ("prompt_logprobs", params.prompt_logprobs is None or 0 <= params.prompt_logprobs <= MAX_LOGPROBS,
         f"in [0, {MAX_LOGPROBS}]"),
    ]
    for name, ok, allowed in ranges:
        if not ok:
            raise InvalidRequest(f"sampling.{name}", f"must be {allowed}, got {getattr(params, name)}")


def check_adapter(lora_name: str, adapters: Collection[str]) -> None:
    """A request's LoRA adapter must be one its workers hold ("": the base model)."""
    if lora_name and lora_name not in adapters:
        raise InvalidRequest("lora_name", f"no LoRA adapter named {lora_name!r} is loaded")
