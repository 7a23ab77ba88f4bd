"""Request validation for the public API: the model name here, everything else through the
rules the scheduler applies too (services/common/request_checks.py)."""

from __future__ import annotations

from vmesh.services.common.request_checks import InvalidRequest, check_prompt, decode_sampling
from vmesh.services.common.types import ModelLimits, SamplingParams
from vmesh.v1 import frontend_pb2

__all__ = ["InvalidRequest", "validate_generate"]


def validate_generate(request: frontend_pb2.GenerateRequest, prompt_token_ids: list[int],
                      limits: ModelLimits) -> SamplingParams:
    """Check a GenerateRequest against the model; return its sampling params with defaults filled:
    the form the frontend forwards (sampling_to_proto), every field set, so later decodes read the same."""
    if request.model and request.model != limits.name:
        raise InvalidRequest(f"model: unknown model {request.model!r} (this server serves {limits.name!r})")
    check_prompt(prompt_token_ids, limits)
    return decode_sampling(request.sampling, len(prompt_token_ids), limits,
                           default_max_tokens=limits.max_model_len - len(prompt_token_ids))
