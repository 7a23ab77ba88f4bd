"""The decoder layers as one C call (services/worker/decoder_stack.py) against the per-op path,
bit for bit, on the default model's native weights: every step of a workload that has decodes,
prefill chunks over cached context, steps that mix the two, and speculative verification rows."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import CHAT_PROMPTS
from vmesh.services.common.types import SamplingParams
from vmesh.services.engine.llm import EngineConfig, LLMEngine
from vmesh.services.speculative.config import SpeculativeConfig
from vmesh.services.worker.decoder_stack import stack_refusal
from vmesh.services.worker.model_runner import ModelRunner, WorkerConfig
from vmesh.services.worker.quantized_linear import DOT_ENV


def load_native(dot: str, monkeypatch: pytest.MonkeyPatch, **worker: object) -> ModelRunner:
    monkeypatch.setenv(DOT_ENV, dot)  # read as the layers are built
    return ModelRunner.load(WorkerConfig(weights="native", kv_cache_memory=32 << 20, max_num_seqs=3,
                                         **worker))  # type: ignore[arg-type]


def step_kinds(meta) -> tuple[bool, bool]:
    """(whether the step had decodes, whether it had prefill chunks or verification rows)."""
    (meta,) = meta if isinstance(meta, list) else [meta]
    items, chunks = meta.backend_cache["cpu_plan"]
    return items is not None, chunks is not None


@pytest.mark.parametrize("dot", ["int8", "float"])
def test_the_stack_equals_the_layers_one_by_one(dot, embedded_tokenizer, monkeypatch):
    runner = load_native(dot, monkeypatch, speculative_config=SpeculativeConfig("ngram", 3, prompt_lookup_min=1,
                                                                                 prompt_lookup_max=3))
    model = runner.model
    assert stack_refusal(model) is None
    assert model._decoder_stack() is not None, "the default model's native layers run as one call"
    one_call, execute = model.final_hidden, runner.execute
    seen: set[tuple[bool, bool, bool]] = set()
    plans = []

    def recorded_execute(plan):
        plans.append(plan)
        return execute(plan)

    def both_paths(input_ids, positions, meta, kv_cache, backend, indices):
        model.decoder_stack_enabled = False
        reference = one_call(input_ids, positions, meta, kv_cache, backend, indices)
        model.decoder_stack_enabled = True
        # The same keys and values go to the same slots again; attention then reads what the
        # stack wrote, so a difference there shows too.
        stacked = one_call(input_ids, positions, meta, kv_cache, backend, indices)
        assert torch.equal(stacked, reference), f"step of {input_ids.numel()} tokens"
        decodes, chunks = step_kinds(meta)
        drafts = any(plans[-1].num_draft_slots)
        seen.add((decodes, chunks, drafts))
        return stacked

    model.final_hidden = both_paths
    runner.execute = recorded_execute
    # A repeated passage gives n-gram drafts; 3 sequences over 5 prompts and small token budgets
    # give chunked prefills beside running decodes.
    prompts = [embedded_tokenizer.encode(p) for p in CHAT_PROMPTS[:3]]
    prompts += [embedded_tokenizer.encode("one two three four five six seven eight " * 12)] * 2
    config = EngineConfig(max_num_batched_tokens=40, max_prefill_tokens_with_decodes=16)
    engine = LLMEngine(runner, embedded_tokenizer, config)
    try:
        outputs = engine.generate(prompts, [SamplingParams(temperature=0, max_tokens=12 + 4 * i, ignore_eos=True)
                                            for i in range(len(prompts))])
    finally:
        engine.shutdown()
    assert [len(o.token_ids) for o in outputs] == [12 + 4 * i for i in range(len(prompts))]
    kinds = {(d, c) for d, c, _ in seen}
    assert {(True, False), (False, True), (True, True)} <= kinds, kinds
    assert any(drafts for *_, drafts in seen), "no step verified drafts"


def test_models_the_stack_does_not_serve_run_one_by_one(monkeypatch):
    """The dequantized default model: float linears, so the layers run one by one, as before."""
    runner = ModelRunner.load(WorkerConfig(weights="dequantized", kv_cache_memory=8 << 20, max_num_seqs=1))
    assert stack_refusal(runner.model) == "a projection that is not a plain quantized linear"
    assert runner.model._decoder_stack() is None
