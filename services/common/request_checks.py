"""What makes a request servable by a model: one set of rules, applied at every door.

The frontend applies them to what clients send; the scheduler applies them again to every
SubmitRequest, whoever sent it, because one bad request that reached the worker would fail the
step it shares with every other request."""

from __future__ import annotations

from collections.abc import Sequence

from vmesh.services.common.types import DEFAULT_MAX_TOKENS, MAX_LOGPROBS, ModelLimits, SamplingParams
from vmesh.services.common.wire.sampling import sampling_from_proto
from vmesh.v1 import common_pb2

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
# Each stop id is checked against every sampled token; a request with a million of them slowed
# its step neighbours ~14x. vLLM's largest practical lists (multi-EOS models) are a handful.
MAX_STOP_TOKEN_IDS = 256


class InvalidRequest(ValueError):
    """A request that cannot be served; the message names the field."""


def check_prompt(prompt_token_ids: Sequence[int], limits: ModelLimits) -> None:
    n = len(prompt_token_ids)
    if n == 0:
        raise InvalidRequest("prompt: empty")
    if n >= limits.max_model_len:
        raise InvalidRequest(f"prompt: {n} tokens; the context holds {limits.max_model_len}, "
                             "so the prompt must be shorter")
    bad = next((t for t in prompt_token_ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"token_ids: {bad} is outside the vocabulary [0, {limits.vocab_size})")


def check_resumed(resumed_output_token_ids: Sequence[int], params: SamplingParams, limits: ModelLimits) -> None:
    """The outputs a failing-over request already has: tokens of the vocabulary, fewer than its budget."""
    n = len(resumed_output_token_ids)
    if n >= params.max_tokens:
        raise InvalidRequest(f"resumed_output_token_ids: {n} tokens leave nothing of max_tokens={params.max_tokens}")
    bad = next((t for t in resumed_output_token_ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"resumed_output_token_ids: {bad} is outside the vocabulary [0, {limits.vocab_size})")


def check_sampling(params: SamplingParams, num_prompt_tokens: int, limits: ModelLimits) -> None:
    """Raise InvalidRequest naming the field as `sampling.<field>`."""
    room = limits.max_model_len - num_prompt_tokens
    if params.max_tokens > room:
        raise InvalidRequest(f"sampling.max_tokens: {params.max_tokens} past the context "
                             f"({num_prompt_tokens} prompt tokens + {params.max_tokens} > {limits.max_model_len})")
    if len(params.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"sampling.stop: {len(params.stop)} stop strings; at most {MAX_STOP_STRINGS}")
    if any(not s or len(s) > MAX_STOP_STRING_CHARS for s in params.stop):
        raise InvalidRequest(f"sampling.stop: each stop string needs 1 to {MAX_STOP_STRING_CHARS} characters")
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(f"sampling.stop_token_ids: {len(params.stop_token_ids)} ids; "
                             f"at most {MAX_STOP_TOKEN_IDS}")
    bad = next((t for t in params.stop_token_ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"sampling.stop_token_ids: {bad} is outside the vocabulary")
    if params.logprobs is not None and params.logprobs > MAX_LOGPROBS:
        raise InvalidRequest(f"sampling.logprobs must be <= {MAX_LOGPROBS}, got {params.logprobs}")
    try:
        params.validate()
    except ValueError as exc:
        raise InvalidRequest(f"sampling.{exc}") from exc


def decode_sampling(pb: common_pb2.SamplingParams, num_prompt_tokens: int, limits: ModelLimits,
                    default_max_tokens: int = DEFAULT_MAX_TOKENS) -> SamplingParams:
    """A request's sampling settings as a door takes them in: decoded, defaults filled, checked.

    The frontend passes the context's room as `default_max_tokens` and forwards the result,
    encoded in full; the scheduler decodes that again here, whoever sent it. Raise
    InvalidRequest naming the field as `sampling.<field>`."""
    params = sampling_from_proto(pb, default_max_tokens)
    check_sampling(params, num_prompt_tokens, limits)
    return params
