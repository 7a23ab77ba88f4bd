"""Request validation for the public API: every rule, one place, one message per field."""

from __future__ import annotations

from dataclasses import dataclass

from services.common import wire
from services.common.sampling_params import SamplingParams
from vmesh.v1 import frontend_pb2

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_LOGPROBS = 20


class InvalidRequest(ValueError):
    pass


@dataclass
class ModelLimits:
    name: str
    max_model_len: int
    vocab_size: int


def validate_generate(request: frontend_pb2.GenerateRequest, prompt_token_ids: list[int],
                      limits: ModelLimits) -> SamplingParams:
    """Check a GenerateRequest against the model; return its sampling params with defaults filled."""
    if request.model and request.model != limits.name:
        raise InvalidRequest(f"model: unknown model {request.model!r} (this server serves {limits.name!r})")
    n = len(prompt_token_ids)
    if n == 0:
        raise InvalidRequest("prompt: empty")
    if n >= limits.max_model_len:
        raise InvalidRequest(f"prompt: {n} tokens; the context holds {limits.max_model_len}, "
                             "so the prompt must be shorter")
    bad = next((t for t in prompt_token_ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"token_ids: {bad} is outside the vocabulary [0, {limits.vocab_size})")
    pb = request.sampling
    if pb.HasField("max_tokens") and pb.max_tokens < 1:
        raise InvalidRequest(f"sampling.max_tokens must be >= 1, got {pb.max_tokens}")
    room = limits.max_model_len - n
    if pb.HasField("max_tokens") and pb.max_tokens > room:
        raise InvalidRequest(f"sampling.max_tokens: {pb.max_tokens} past the context "
                             f"({n} prompt tokens + {pb.max_tokens} > {limits.max_model_len})")
    if len(pb.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"sampling.stop: {len(pb.stop)} stop strings; at most {MAX_STOP_STRINGS}")
    if any(not s or len(s) > MAX_STOP_STRING_CHARS for s in pb.stop):
        raise InvalidRequest(f"sampling.stop: each stop string needs 1 to {MAX_STOP_STRING_CHARS} characters")
    if pb.HasField("logprobs") and pb.logprobs > MAX_LOGPROBS:
        raise InvalidRequest(f"sampling.logprobs must be <= {MAX_LOGPROBS}, got {pb.logprobs}")
    bad = next((t for t in pb.stop_token_ids if t >= limits.vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"sampling.stop_token_ids: {bad} is outside the vocabulary")
    params = wire.sampling_from_proto(pb, default_max_tokens=room)
    try:
        params.validate()
    except ValueError as exc:
        raise InvalidRequest(f"sampling.{exc}") from exc
    return params
