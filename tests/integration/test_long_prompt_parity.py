"""Greedy parity with transformers on 2,000-token prompts (the long workload's), through the
in-process engine: whole prompts beside one another in one step, and prompts cut into
chunks that each attend to the cached chunks before them, at pipeline depth 1 and 2. Every
prefill here goes through the tiled C attention kernel on CPU."""

from __future__ import annotations

import pytest

from tests.support.reference import assert_greedy_match, hf_greedy
from vmesh.services.bench.common import load_workload
from vmesh.services.common.types import SamplingParams
from vmesh.services.engine.llm import EngineConfig, LLMEngine
from vmesh.services.worker.model_runner import ModelRunner, WorkerConfig

OUTPUT_TOKENS = 8


@pytest.fixture(scope="module")
def long_prompts():
    prompts = load_workload("long", 2, None)["prompts"]
    assert all(len(p) == 2000 for p in prompts)
    return prompts


@pytest.fixture(scope="module")
def long_references(embedded_reference_model, long_prompts):
    return [hf_greedy(embedded_reference_model, p, OUTPUT_TOKENS) for p in long_prompts]


@pytest.fixture(scope="module")
def runner(embedded_model_dir):
    return ModelRunner.load(WorkerConfig(model=str(embedded_model_dir), kv_cache_memory=256 << 20, max_num_seqs=4))


@pytest.mark.parametrize(("budget", "depth", "prefill_cap"), [(4096, 2, 0), (512, 1, 0), (768, 2, 0), (2048, 2, 256)])
def test_long_prompts_match_transformers(monkeypatch, runner, embedded_tokenizer, long_prompts, long_references,
                                         budget, depth, prefill_cap):
    """budget 4096: both prompts whole in one step; 512: four chunks each, on block edges;
    768: chunks that start and end mid-block, a step holding the end of one prompt and the
    start of the other; 2048, decode first: the second prompt's chunks capped at 256 tokens
    while the first one decodes."""
    from vmesh.services.worker.persistent_batch import PersistentBatch

    tiled = runner.backend.kernels.prefill_attention
    calls = []
    monkeypatch.setattr(runner.backend.kernels, "prefill_attention", lambda *args: calls.append(1) or tiled(*args))
    runner.batch = PersistentBatch(runner.batch.max_num_reqs, runner.max_model_len, runner.kv_cache.block_size,
                                   runner.model.device, runner.kv_cache.num_blocks)
    runner.last_step = -1
    engine = LLMEngine(runner, embedded_tokenizer, EngineConfig(max_num_batched_tokens=budget, pipeline_depth=depth,
                                                                 max_prefill_tokens_with_decodes=prefill_cap))
    try:
        outs = engine.generate(long_prompts, SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True))
        for i, out in enumerate(outs):
            assert_greedy_match(out.token_ids, long_references[i], label=f"long prompt {i}")
        assert len(calls) >= 30 * -(-4000 // budget), "every layer of every prefill step takes the tiled kernel"
        assert engine.scheduler.pool.num_free == engine.scheduler.pool.num_blocks
    finally:
        engine.shutdown()
