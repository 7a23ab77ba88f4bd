"""The one sampling decoder (wire.sampling_from_proto, then admission.admit at each door):
defaults filled once at the frontend, and what it forwards decodes to the same settings
wherever it is read again."""

from __future__ import annotations

import pytest

from vmesh.services.common.admission import InvalidRequest, admit
from vmesh.services.common.types import DEFAULT_MAX_TOKENS, ModelLimits, OutputMode, SamplingParams
from vmesh.services.common.wire.sampling import sampling_from_proto, sampling_to_proto
from vmesh.v1 import common_pb2

LIMITS = ModelLimits(name="m", max_model_len=64, vocab_size=100)


def decode_sampling(pb: common_pb2.SamplingParams, num_prompt_tokens: int, limits: ModelLimits,
                    default_max_tokens: int = DEFAULT_MAX_TOKENS) -> SamplingParams:
    """What a door does with a request's sampling settings: decode them, then admit the request."""
    params = sampling_from_proto(pb, default_max_tokens)
    admit([1] * num_prompt_tokens, params, limits)
    return params


def test_unset_fields_take_their_documented_defaults() -> None:
    params = decode_sampling(common_pb2.SamplingParams(), num_prompt_tokens=4, limits=LIMITS)
    assert params == SamplingParams(max_tokens=DEFAULT_MAX_TOKENS, output_mode=OutputMode.DELTA)


def test_the_frontend_default_fills_max_tokens_to_the_context() -> None:
    params = decode_sampling(common_pb2.SamplingParams(), 4, LIMITS, default_max_tokens=60)
    assert params.max_tokens == 60


def test_forwarded_form_decodes_to_the_same_params_at_every_later_door() -> None:
    client = common_pb2.SamplingParams(temperature=0.5, top_k=3, seed=(1 << 64) - 1, stop=["x"], logprobs=2,
                                       stop_token_ids=[7], output_mode=common_pb2.OUTPUT_MODE_FINAL_ONLY)
    at_frontend = decode_sampling(client, 10, LIMITS, default_max_tokens=LIMITS.max_model_len - 10)
    forwarded = common_pb2.SamplingParams.FromString(sampling_to_proto(at_frontend).SerializeToString())
    # The scheduler's own default (16) never applies: the forwarded form sets every field.
    assert decode_sampling(forwarded, 10, LIMITS) == at_frontend
    assert sampling_from_proto(forwarded) == at_frontend  # as the detokenizer and worker read it
    assert at_frontend.max_tokens == 54 and at_frontend.logprobs == 2 and at_frontend.seed == (1 << 64) - 1


@pytest.mark.parametrize(("settings", "field"), [
    ({"top_p": 0.0}, "sampling.top_p"), ({"max_tokens": 61}, "sampling.max_tokens"),
    ({"logprobs": 21}, "sampling.logprobs"), ({"stop_token_ids": [100]}, "sampling.stop_token_ids"),
    ({"temperature": float("nan")}, "sampling.temperature"),
])
def test_out_of_range_settings_are_refused_naming_the_field(settings: dict, field: str) -> None:
    with pytest.raises(InvalidRequest, match=field):
        decode_sampling(common_pb2.SamplingParams(**settings), 4, LIMITS)
