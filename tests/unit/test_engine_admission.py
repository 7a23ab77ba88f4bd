"""The in-process engine's door applies the mesh's request rules: what the frontend and the
scheduler refuse, LLMEngine.add_request refuses too, naming the same field."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vmesh.services.common.admission import MAX_STOP_STRINGS, InvalidRequest
from vmesh.services.common.kv_cache_groups import single_group_layout
from vmesh.services.common.types import SamplingParams
from vmesh.services.engine.llm import EngineConfig, LLMEngine


def engine() -> LLMEngine:
    """An engine over a runner that is never stepped: admission happens before any step."""
    runner = SimpleNamespace(kv_cache=SimpleNamespace(num_blocks=8, block_size=4, layout=single_group_layout(1)),
                             max_model_len=32,
                             batch=SimpleNamespace(max_num_reqs=4),
                             spec=SimpleNamespace(eos_token_ids=[0], vocab_size=100), speculative=None, lora=None)
    return LLMEngine(runner, SimpleNamespace(backend_tokenizer=None), EngineConfig())  # type: ignore[arg-type]


@pytest.mark.parametrize(("prompt", "params", "field"), [
    ([], SamplingParams(), "prompt"),
    (list(range(1, 33)), SamplingParams(), "prompt"),
    ([1, 100], SamplingParams(), "token_ids"),
    ([1, 2], SamplingParams(max_tokens=31), "sampling.max_tokens"),
    ([1, 2], SamplingParams(top_p=0.0), "sampling.top_p"),
    ([1, 2], SamplingParams(temperature=float("nan")), "sampling.temperature"),
    ([1, 2], SamplingParams(logprobs=21), "sampling.logprobs"),
    ([1, 2], SamplingParams(stop=["x"] * (MAX_STOP_STRINGS + 1)), "sampling.stop"),
    ([1, 2], SamplingParams(stop=[""]), "sampling.stop"),
    ([1, 2], SamplingParams(stop_token_ids=[100]), "sampling.stop_token_ids"),
])
def test_the_engine_refuses_what_the_mesh_refuses(prompt: list[int], params: SamplingParams, field: str) -> None:
    llm = engine()
    try:
        with pytest.raises(InvalidRequest) as refused:
            llm.add_request(prompt, params)
        assert refused.value.field == field and str(refused.value).startswith(f"{field}: ")
        assert not llm.has_unfinished() and not llm.outputs
        llm.add_request([1, 2], SamplingParams(max_tokens=30))  # the next one is taken
        assert llm.has_unfinished()
    finally:
        llm.shutdown()
