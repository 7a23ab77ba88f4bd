"""Gemma 3 270M from its real GGUF (the optional `gemma` extra, which CI installs): greedy tokens
through the in-process engine equal to transformers float32 loading the same GGUF, on plain-text
completions (a base model), one prompt past the 512-token window so that the local layers slide,
prefilled in chunks that cross the window's edge. The 20-prompt, 4k-token version, and the same
against `--weights native`, is `python -m benchmarks.gemma3_parity` (benchmarks/README.md): a
native load here would cost as much again as the rest of this file (CPU seconds, mostly the
gguf package's pure-Python metadata reader and dequantizer)."""

from __future__ import annotations

import pytest

from tests.support.gemma3 import SHORT_PROMPTS, gemma3_files, long_prompt, reference_model
from tests.support.reference import assert_greedy_match, hf_greedy
from vmesh.services.common.model_loading import load_model_spec
from vmesh.services.common.tokenizer import load_chat_tokenizer
from vmesh.services.common.types import SamplingParams
from vmesh.services.engine.llm import EngineConfig, LLMEngine
from vmesh.services.worker.model_runner import ModelRunner, WorkerConfig

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


def test_gemma3_greedy_matches_transformers_on_the_same_gguf(gemma3):
    model_dir, tokenizer, prompts, references = gemma3
    assert len(prompts[-1]) > WINDOW
    runner = ModelRunner.load(WorkerConfig(model=str(model_dir), kv_cache_memory=128 << 20, max_num_seqs=4,
                                           max_model_len=1024))
    # Chunks of 200 tokens: the long prompt's third chunk straddles the window's edge.
    engine = LLMEngine(runner, tokenizer, EngineConfig(max_num_batched_tokens=200, pipeline_depth=2))
    try:
        outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    finally:
        engine.shutdown()
    for i, out in enumerate(outs):
        assert_greedy_match(out.token_ids, references[i], label=f"gemma3 prompt {i} ({len(prompts[i])} tokens)")

