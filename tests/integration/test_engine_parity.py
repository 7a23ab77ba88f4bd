"""The in-process engine (scheduler + worker + detokenizer) against transformers: 16 chat
prompts, greedy, with preemption, prefix-cache hits, chunked prefill, pipeline depth 1 and 2."""

from __future__ import annotations

import asyncio

import pytest

from tests.conftest import CHAT_PROMPTS
from tests.support.eventually import eventually_blocking
from tests.support.reference import assert_greedy_match, hf_greedy
from vmesh.services.common.types import SamplingParams
from vmesh.services.engine.llm import EngineConfig, LLMEngine
from vmesh.services.worker.model_runner import ModelRunner, WorkerConfig

GREEDY_32 = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
LONG_SYSTEM = ("You are a meticulous assistant for a public library. Answer briefly, cite no sources, be kind, "
               "avoid jargon, and when a question is ambiguous pick the most common reading of it. Patrons ask about "
               "books, opening hours, history, science and everyday life.")


@pytest.fixture(scope="module")
def runner(embedded_model_dir):
    return ModelRunner.load(WorkerConfig(model=str(embedded_model_dir), kv_cache_memory=64 << 20, max_num_seqs=32))


def make_engine(runner, tokenizer, *, num_blocks=None, budget=2048, depth=2):
    """An engine over the shared model runner, with a fresh batch, scheduler and (optionally) a smaller pool."""
    from vmesh.services.worker.persistent_batch import PersistentBatch

    runner.batch = PersistentBatch(runner.batch.max_num_reqs, runner.max_model_len, runner.kv_cache.block_size,
                                   runner.model.device, runner.kv_cache.num_blocks)
    runner.last_step = -1
    saved = runner.kv_cache.num_blocks
    if num_blocks is not None:
        runner.kv_cache.num_blocks = num_blocks  # the scheduler only hands out the first num_blocks
    try:
        return LLMEngine(runner, tokenizer, EngineConfig(max_num_batched_tokens=budget, pipeline_depth=depth))
    finally:
        runner.kv_cache.num_blocks = saved


@pytest.mark.parametrize("depth", [1, 2])
def test_parity_with_preemption(runner, embedded_tokenizer, chat_prompt_ids, reference_outputs, depth):
    engine = make_engine(runner, embedded_tokenizer, num_blocks=30, depth=depth)
    outs = engine.generate(chat_prompt_ids, GREEDY_32)
    assert engine.scheduler.num_preemptions > 0, "the small pool should force preemption"
    for i, out in enumerate(outs):
        assert_greedy_match(out.token_ids, reference_outputs[i], label=f"prompt {i}")
    assert engine.scheduler.pool.num_free == engine.scheduler.pool.num_blocks
    engine.shutdown()


@pytest.mark.parametrize("depth", [1, 2])
def test_parity_with_chunked_prefill(runner, embedded_tokenizer, chat_prompt_ids, reference_outputs, depth):
    engine = make_engine(runner, embedded_tokenizer, budget=24, depth=depth)
    outs = engine.generate(chat_prompt_ids, GREEDY_32)
    for i, out in enumerate(outs):
        assert_greedy_match(out.token_ids, reference_outputs[i], label=f"prompt {i}")
    engine.shutdown()


@pytest.fixture(scope="module")
def shared_prefix_prompts(embedded_tokenizer, embedded_reference_model):
    prompts = [embedded_tokenizer.apply_chat_template(
        [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": q}],
        add_generation_prompt=True, tokenize=True, return_dict=False) for q in CHAT_PROMPTS]
    return prompts, [hf_greedy(embedded_reference_model, p, 16) for p in prompts]


def test_parity_with_prefix_cache_hits(runner, embedded_tokenizer, shared_prefix_prompts):
    prompts, references = shared_prefix_prompts
    engine = make_engine(runner, embedded_tokenizer)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    # One request first, so the shared prefix is cached before the rest arrive.
    first = engine.generate(prompts[:1], params)
    rest = engine.generate(prompts[1:], params)
    stats = engine.scheduler.stats()
    assert stats.prefix_hits > 0
    cached = [o.num_cached_prompt_tokens for o in rest]
    assert min(cached) >= 48, f"the shared system prompt should be reused: {cached}"
    prompt_tokens = sum(len(p) for p in prompts)
    computed_prompt_tokens = stats.num_scheduled_tokens - 16 * (16 - 1)  # minus decode steps
    assert computed_prompt_tokens < prompt_tokens - 15 * 48
    for i, out in enumerate(first + rest):
        assert_greedy_match(out.token_ids, references[i], label=f"shared-prefix prompt {i}")
    engine.shutdown()


def test_async_stream_and_cancel_free_blocks(runner, embedded_tokenizer, chat_prompt_ids, reference_outputs):
    engine = make_engine(runner, embedded_tokenizer)

    async def main():
        collected = []
        async for out in engine.stream(chat_prompt_ids[0], GREEDY_32):
            collected += out.new_token_ids
        cancelled = 0
        async for _out in engine.stream(chat_prompt_ids[1], SamplingParams(temperature=0, max_tokens=200)):
            cancelled += 1
            if cancelled == 3:
                break  # the generator closes: the request is aborted
        return collected

    tokens = asyncio.run(main())
    assert_greedy_match(tokens, reference_outputs[0], label="streamed prompt 0")
    eventually_blocking(lambda: not engine.has_unfinished(), "the driver thread kept steps in flight")
    assert engine.scheduler.stats().num_running == 0
    assert engine.scheduler.pool.num_free == engine.scheduler.pool.num_blocks
    engine.shutdown()
