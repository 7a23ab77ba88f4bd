"""Gemma 3 270M (the optional `gemma` extra) under `--weights native`: its Q4_K, Q6_K, Q5_0 and Q8_0
linears all keep the file's blocks (q/k/v of the layers whose v is Q8_0 joined as Q8_0, an exact
widening of Q5_0), and greedy decoding through the in-process engine parts from `--weights
dequantized` (every block expanded to float32: what `--weights native` ran these formats on before
the kernels read them) only where the reference itself barely chose. Three short prompts, 16
tokens each: the load (the gguf package's pure-Python reader) is most of this file's time."""

from __future__ import annotations

import logging

import pytest

from tests.integration.test_native_weights import INT8_NEAR_TIE, _first_divergence
from tests.support.gemma3 import SHORT_PROMPTS, gemma3_files
from tests.support.reference import NEAR_TIE
from vmesh.services.common.model_loading import GEMMA3_MODEL_ALIAS
from vmesh.services.common.tokenizer import load_chat_tokenizer
from vmesh.services.common.types import SamplingParams
from vmesh.services.engine.llm import EngineConfig, LLMEngine
from vmesh.services.worker.model_runner import ModelRunner, WorkerConfig
from vmesh.services.worker.quantized_linear import QuantizedLinear

NEW_TOKENS = 16
PROMPTS = 3


def _load(weights: str, model: str) -> ModelRunner:
    return ModelRunner.load(WorkerConfig(model=model, weights=weights, kv_cache_memory=32 << 20, max_num_seqs=4,
                                         max_model_len=256))


@pytest.fixture(scope="module")
def gemma3():
    _gguf, model_dir = gemma3_files()
    tokenizer = load_chat_tokenizer(model_dir)
    return model_dir, tokenizer, [tokenizer.encode(text) for text in SHORT_PROMPTS[:PROMPTS]]


@pytest.fixture(scope="module")
def native(gemma3):
    """The native runner (int8 dot products where the CPU has VNNI) and its load report."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("vmesh.services.worker.quantized_linear")
    logger.addHandler(handler)
    previous_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        runner = _load("native", GEMMA3_MODEL_ALIAS)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous_level)
    return runner, [record.getMessage() for record in records]


def _greedy(runner: ModelRunner, tokenizer, prompts: list[list[int]]) -> list:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    engine = LLMEngine(runner, tokenizer, EngineConfig())
    try:
        return engine.generate(prompts, params)
    finally:
        engine.shutdown()


def test_every_linear_keeps_the_files_blocks(native):
    runner, report = native
    linears = runner.model.linears()
    assert all(isinstance(layer, QuantizedLinear) for layer in linears)
    # 18 layers x (qkv, o, gate_up, down) + the tied head: o is Q4_K, down Q4_K or Q6_K (9 each),
    # gate_up Q5_0, qkv Q5_0 or (v stored as Q8_0) Q8_0 (9 each), the head Q8_0.
    formats = [layer.format for layer in linears]
    assert {name: formats.count(name) for name in set(formats)} == {"Q4_K": 27, "Q6_K": 9, "Q5_0": 27, "Q8_0": 10}
    placement = next(message for message in report if message.startswith("native GGUF weights"))
    assert f"{len(linears)} of {len(linears)} linears read quantized blocks" in placement
    assert "dequantized to float32" not in placement
    assert len({layer.integer for layer in linears}) == 1, "one kernel for every format"


def test_greedy_tokens_part_from_dequantized_only_at_near_ties(gemma3, native):
    model_dir, tokenizer, prompts = gemma3
    runner, _report = native
    # int8-rounded activations (VNNI): INT8_NEAR_TIE, the rule test_native_weights.py states for
    # SmolLM2's Q4_1. On Gemma, 10 prompts x 32 tokens (benchmarks/README.md, "K-quants"): 8 identical,
    # the other two parting where the reference's top-two gap was 0.054 and 0.005. The float32 kernel
    # (no VNNI) multiplies the same values as the reference: identical on all 10, so NEAR_TIE.
    near_tie = INT8_NEAR_TIE if runner.model.lm_head.integer else NEAR_TIE
    ours = _greedy(runner, tokenizer, prompts)
    references = _greedy(_load("dequantized", str(model_dir)), tokenizer, prompts)
    for i, (out, reference) in enumerate(zip(ours, references)):
        assert len(out.token_ids) == len(reference.token_ids) == NEW_TOKENS
        at = _first_divergence(out.token_ids, reference.token_ids)
        if at is not None:
            top = reference.logprobs[at].top_logprobs
            gap = top[0] - top[1]
            assert gap < near_tie, (f"prompt {i} diverges at token {at}: {out.token_ids[at]} != "
                                    f"{reference.token_ids[at]} (reference logit gap {gap:.2e})")
