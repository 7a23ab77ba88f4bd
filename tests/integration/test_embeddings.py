"""Embedding requests (SamplingParams.pooling) on the in-process engine against transformers'
float32 final hidden states pooled the same way: LAST and MEAN, normalised or not (and CLS), in one prefill
and across chunked prefill, beside a generation whose tokens stay the reference's, with the
prompt in the prefix cache (LAST reads it, MEAN does not), and after a lost worker mid-prefill."""

from __future__ import annotations

import pytest

from tests.integration.test_engine_parity import LONG_SYSTEM, make_engine
from tests.support.reference import assert_embedding_matches, assert_greedy_match, hf_final_hidden, hf_greedy, pooled
from vmesh.services.common.types import Pooling, PoolingType, SamplingParams
from vmesh.services.worker.model_runner import ModelRunner, WorkerConfig

POOLINGS = [*(Pooling(t, normalize) for t in (PoolingType.LAST, PoolingType.MEAN) for normalize in (True, False)),
            Pooling(PoolingType.CLS, normalize=False)]
GENERATE = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def embed(pooling: Pooling) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=1, pooling=pooling)


@pytest.fixture(scope="module")
def runner(embedded_model_dir):
    return ModelRunner.load(WorkerConfig(model=str(embedded_model_dir), kv_cache_memory=16 << 20, max_num_seqs=8))


@pytest.fixture(scope="module")
def prompts(embedded_tokenizer):
    questions = ["What is the capital of France?", "Why is the sky blue?"]
    return [embedded_tokenizer.apply_chat_template(
        [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": q}],
        add_generation_prompt=True, tokenize=True, return_dict=False) for q in questions]


@pytest.fixture(scope="module")
def hidden(embedded_reference_model, prompts):
    """Each prompt's final hidden states in transformers, float32."""
    return [hf_final_hidden(embedded_reference_model, p) for p in prompts]


# Chunked: a 32-token budget cuts each prompt (~70 tokens) into chunks shared with the other requests.
@pytest.mark.parametrize(("budget", "poolings"), [(2048, POOLINGS), (32, [POOLINGS[0], POOLINGS[3]])],
                         ids=["one-prefill", "chunked"])
def test_embeddings_match_transformers_beside_a_generation(runner, embedded_tokenizer, embedded_reference_model,
                                                            prompts, hidden, budget, poolings):
    engine = make_engine(runner, embedded_tokenizer, budget=budget)
    outs = engine.generate([prompts[0]] * len(poolings) + [prompts[1]], [embed(p) for p in poolings] + [GENERATE])
    engine.shutdown()
    for out, pooling in zip(outs, poolings):
        assert_embedding_matches(out.embedding, pooled(hidden[0], pooling.type.value, pooling.normalize))
    assert outs[-1].embedding == []
    assert_greedy_match(outs[-1].token_ids, hf_greedy(embedded_reference_model, prompts[1], GENERATE.max_tokens))


def test_last_pooling_reads_the_prefix_cache_and_mean_does_not(runner, embedded_tokenizer, prompts, hidden):
    engine = make_engine(runner, embedded_tokenizer)
    engine.generate([prompts[1]], GENERATE)  # caches the prompt's full blocks
    last, mean = engine.generate([prompts[1]] * 2, [embed(Pooling(PoolingType.LAST)), embed(Pooling(PoolingType.MEAN))])
    engine.shutdown()
    assert last.num_cached_prompt_tokens > 0, "LAST needs only the last position, which is always computed"
    assert mean.num_cached_prompt_tokens == 0, "MEAN computes every position"
    assert_embedding_matches(last.embedding, pooled(hidden[1], "LAST", True))
    assert_embedding_matches(mean.embedding, pooled(hidden[1], "MEAN", True))


def test_mean_pooling_after_a_lost_worker_mid_prefill(runner, embedded_tokenizer, prompts, hidden):
    """The worker is lost two chunks into the prompt (its replacement starts empty; the scheduler
    recomputes every request): the request pools its whole prompt again, once."""
    engine = make_engine(runner, embedded_tokenizer, budget=13, depth=1)
    engine.add_request(prompts[0], embed(Pooling(PoolingType.MEAN, normalize=False)), request_id="mid-prefill")
    engine.step()
    engine.step()
    assert engine.scheduler.requests["mid-prefill"].num_computed_tokens == 26, "two chunks of the prompt are in"
    engine.scheduler.recompute_all()
    runner.reset()
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    engine.shutdown()
    vectors = [out.embedding for out in outputs if out.embedding]
    assert len(vectors) == 1
    assert_embedding_matches(vectors[0], pooled(hidden[0], "MEAN", False))
