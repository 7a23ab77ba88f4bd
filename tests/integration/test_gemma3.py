"""Gemma 3 270M from its real GGUF (the optional `gemma` extra, which CI installs): greedy tokens
through the in-process engine equal to transformers float32 loading the same GGUF, on plain-text
completions (a base model), one prompt past the 512-token window so that the local layers slide,
prefilled in chunks that cross the window's edge, at pipeline depth 2 and again at depth 1 in a
pool small enough to preempt; the local layers' KV cache groups hold only their window's blocks
(services/scheduler/kv_cache_manager.py), counted against the all-global layout. The 20-prompt,
4k-token version, and the same against `--weights native`, is `python -m benchmarks.gemma3_parity`
(benchmarks/README.md): a native load here would cost as much again as the rest of this file
(CPU seconds, mostly the gguf package's pure-Python metadata reader and dequantizer)."""

from __future__ import annotations

import pytest

from tests.support.gemma3 import SHORT_PROMPTS, gemma3_files, long_prompt, reference_model
from tests.support.reference import assert_greedy_match, hf_greedy
from vmesh.services.common.model_loading import load_model_spec
from vmesh.services.common.tokenizer import load_chat_tokenizer
from vmesh.services.common.types import SamplingParams
from vmesh.services.engine.llm import EngineConfig, LLMEngine
from vmesh.services.worker.model_runner import ModelRunner, WorkerConfig
from vmesh.services.worker.persistent_batch import PersistentBatch

NEW_TOKENS = 24
WINDOW = 512
LONG_PROMPT = 640  # past the window: the last 128 prompt tokens and every new one see only 512


@pytest.fixture(scope="module")
def gemma3():
    gguf, model_dir = gemma3_files()
    tokenizer = load_chat_tokenizer(model_dir)
    prompts = [tokenizer.encode(text) for text in SHORT_PROMPTS[:2]] + [long_prompt(tokenizer, LONG_PROMPT)]
    reference = reference_model(gguf)
    references = [hf_greedy(reference, p, NEW_TOKENS) for p in prompts]
    del reference
    return model_dir, tokenizer, prompts, references


def test_the_converted_model_is_gemma3_as_the_file_declares_it(gemma3):
    model_dir, _tokenizer, _prompts, _references = gemma3
    spec = load_model_spec(model_dir)
    assert (spec.architecture, spec.vocab_size, spec.num_layers, spec.hidden_size) == (
        "Gemma3ForCausalLM", 262_144, 18, 640)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.tie_word_embeddings) == (4, 1, 256, True)
    windows = [layer.attention.window for layer in spec.layers]
    assert windows == ([WINDOW] * 5 + [None]) * 3  # five local layers, then a global one
    assert spec.eos_token_ids == (1, 106)  # <eos>, and <end_of_turn> for the turn format


def test_chat_renders_gemmas_turns_into_its_own_control_tokens(gemma3):
    _model_dir, tokenizer, _prompts, _references = gemma3
    ids = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Hi"}])
    assert tokenizer.convert_ids_to_tokens(ids[:3]) == ["<bos>", "<start_of_turn>", "user"]
    assert ids[-3:] == tokenizer.encode("<start_of_turn>model\n", add_special_tokens=False)
    assert 106 in ids  # <end_of_turn>, one token


@pytest.fixture(scope="module")
def runner(gemma3):
    model_dir, _tokenizer, _prompts, _references = gemma3
    return ModelRunner.load(WorkerConfig(model=str(model_dir), kv_cache_memory=128 << 20, max_num_seqs=4,
                                         max_model_len=1024))


def _engine(runner, tokenizer, depth: int, budget: int, num_blocks: int | None = None) -> LLMEngine:
    runner.batch = PersistentBatch(runner.batch.max_num_reqs, runner.max_model_len, runner.kv_cache.block_size,
                                   runner.model.device, runner.kv_cache.num_blocks, runner.batch.grammar_tokenizer,
                                   runner.kv_cache.num_groups)
    runner.last_step = -1
    saved = runner.kv_cache.num_blocks
    if num_blocks is not None:
        runner.kv_cache.num_blocks = num_blocks  # the scheduler hands out only the first num_blocks
    try:
        return LLMEngine(runner, tokenizer, EngineConfig(max_num_batched_tokens=budget, pipeline_depth=depth))
    finally:
        runner.kv_cache.num_blocks = saved


def _record_blocks_held(scheduler, request_id: str) -> list[tuple[int, int, int]]:
    """After every plan: (tokens computed, entries per group table, blocks held) of `request_id`."""
    seen: list[tuple[int, int, int]] = []
    schedule = scheduler.schedule

    def recording():
        plan = schedule()
        request = scheduler.requests.get(request_id)
        if request is not None and len(request.tables):
            seen.append((request.num_computed_tokens, len(request.tables), len(request.block_ids)))
        return plan
    scheduler.schedule = recording
    return seen


# Chunks of 200 tokens (the long prompt's third straddles the window's edge), or of 72 (the
# eighth does) in a pool of 235 blocks: the long request's window groups peak at 226 blocks, and
# with the short ones running it is preempted, then readmitted on its own cached blocks (a prefix
# hit in every group). 235 is just above the most one 664-token request may need (232).
@pytest.mark.parametrize("depth, budget, num_blocks", [(2, 200, None), (1, 72, 235)])
def test_gemma3_greedy_matches_transformers_on_the_same_gguf(gemma3, runner, depth, budget, num_blocks):
    _model_dir, tokenizer, prompts, references = gemma3
    assert len(prompts[-1]) > WINDOW
    windows = runner.kv_cache.layout.windows
    assert windows == (None,) + (WINDOW,) * 5 and runner.kv_cache.layout.slots_per_block == 3
    engine = _engine(runner, tokenizer, depth, budget, num_blocks)
    held = _record_blocks_held(engine.scheduler, "req-2")  # the long prompt's request (the engine counts from 0)
    try:
        outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
        assert engine.scheduler.pool.num_free == engine.scheduler.pool.num_blocks
        assert (engine.scheduler.num_preemptions > 0) == (num_blocks is not None)
        assert (engine.scheduler.pool.prefix_hits > 0) == (num_blocks is not None)
    finally:
        engine.shutdown()
    for i, out in enumerate(outs):
        assert_greedy_match(out.token_ids, references[i], label=f"gemma3 prompt {i} ({len(prompts[i])} tokens)")
    # The long request's last plan: the global group holds every block of its context, each of the
    # five local groups only those its next query sees (from position - 511 on). All-global, the
    # same layers would need 6 blocks (of 3 layers) for every entry.
    computed, entries, blocks = held[-1]
    assert computed == len(prompts[-1]) + NEW_TOKENS - 1 and entries == -(-computed // 16)
    behind_window = (computed - 1 - WINDOW + 1) // 16  # blocks wholly before the last query's window
    assert blocks == entries + 5 * (entries - behind_window)
    assert (entries, blocks) == (42, 207)  # 640 + 23 tokens: 207 blocks where all-global needs 6 x 42 = 252

