"""Prompt logprobs from the in-process engine against transformers' float32 log-softmax over the
prompt: in one prefill, across chunked prefill, where the prefix cache holds the prompt, under
preemption, and beside requests that ask for none."""

from __future__ import annotations

import pytest

from tests.integration.test_engine_parity import LONG_SYSTEM, make_engine
from tests.support.reference import assert_prompt_logprobs_match, hf_prompt_logprobs
from vmesh.services.common.types import SamplingParams
from vmesh.services.worker.model_runner import ModelRunner, WorkerConfig

NUM_TOP = 3
ASKING = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=NUM_TOP)
PLAIN = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


@pytest.fixture(scope="module")
def runner(embedded_model_dir):
    return ModelRunner.load(WorkerConfig(model=str(embedded_model_dir), kv_cache_memory=16 << 20, max_num_seqs=8))


@pytest.fixture(scope="module")
def prompts(embedded_tokenizer, embedded_reference_model):
    questions = ["What is the capital of France?", "Name a famous painter.", "Why is the sky blue?"]
    ids = [embedded_tokenizer.apply_chat_template(
        [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": q}],
        add_generation_prompt=True, tokenize=True, return_dict=False) for q in questions]
    return ids, [hf_prompt_logprobs(embedded_reference_model, p) for p in ids]


@pytest.mark.parametrize("budget", [2048, 13], ids=["one-prefill", "chunked"])
def test_prompt_logprobs_match_transformers(runner, embedded_tokenizer, prompts, budget):
    ids, references = prompts
    engine = make_engine(runner, embedded_tokenizer, budget=budget)
    # Beside a request that asks nothing: its own outputs carry no prompt rows.
    outs = engine.generate([ids[0], ids[1]], [ASKING, PLAIN])
    engine.shutdown()
    assert_prompt_logprobs_match(outs[0].prompt_logprobs, ids[0], references[0], NUM_TOP)
    assert outs[1].prompt_logprobs == []


def test_prompt_logprobs_with_the_prompt_in_the_prefix_cache(runner, embedded_tokenizer, prompts):
    ids, references = prompts
    engine = make_engine(runner, embedded_tokenizer)
    engine.generate([ids[2]], PLAIN)  # caches the prompt's full blocks
    plain, asking = engine.generate([ids[2], ids[2]], [PLAIN, ASKING])
    engine.shutdown()
    assert plain.num_cached_prompt_tokens > 0, "the plain request reads the cached prefix"
    assert asking.num_cached_prompt_tokens == 0, "the asking request computes every position"
    assert_prompt_logprobs_match(asking.prompt_logprobs, ids[2], references[2], NUM_TOP)


def test_prompt_logprobs_survive_preemption(runner, embedded_tokenizer, prompts):
    ids, references = prompts
    # Too few blocks for all three to run to the end at once: one is preempted and recomputed.
    engine = make_engine(runner, embedded_tokenizer, num_blocks=14, budget=64)
    long_tail = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=NUM_TOP)
    outs = engine.generate(ids, long_tail)
    assert engine.scheduler.num_preemptions > 0, "the small pool should force preemption"
    engine.shutdown()
    for out, prompt, reference in zip(outs, ids, references):
        assert_prompt_logprobs_match(out.prompt_logprobs, prompt, reference, NUM_TOP)


def _run_to_end(engine) -> list:
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    return outputs


def test_prompt_logprobs_after_a_lost_worker(runner, embedded_tokenizer, prompts):
    """The worker is lost (its replacement starts empty; the scheduler recomputes every request):
    mid-prefill, the request scores its whole prompt again, with the same values; after its first
    token, when the client has them, it resumes without sending them twice."""
    ids, references = prompts
    engine = make_engine(runner, embedded_tokenizer, budget=13, depth=1)
    engine.add_request(ids[0], ASKING, request_id="mid-prefill")
    engine.step()
    engine.step()
    assert engine.scheduler.requests["mid-prefill"].num_computed_tokens == 26, "two chunks of the prompt are in"
    engine.scheduler.recompute_all()
    runner.reset()
    outputs = _run_to_end(engine)
    assert_prompt_logprobs_match([row for out in outputs for row in out.prompt_logprobs], ids[0], references[0],
                                 NUM_TOP)

    engine.add_request(ids[1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=NUM_TOP),
                       request_id="after-first-token")
    first = []
    while not first or not first[-1].new_token_ids:
        first += engine.step()
    engine.scheduler.recompute_all()
    runner.reset()
    outputs = first + _run_to_end(engine)
    engine.shutdown()
    assert next(len(out.prompt_logprobs) > 0 for out in outputs if out.new_token_ids), "with the first token"
    assert_prompt_logprobs_match([row for out in outputs for row in out.prompt_logprobs], ids[1], references[1],
                                 NUM_TOP)
    assert sum(len(out.new_token_ids) for out in outputs) == 4
