"""Speculative decoding changes no output: the in-process engine with n-gram or suffix proposals
against the same engine without, token for token, at pipeline depth 1 and 2, under preemption
and prefix-cache hits, for greedy and seeded rows with penalties, min_tokens and stop tokens;
and on the embedded model copying a text (where most drafts are accepted), greedy and seeded,
with the logprobs of accepted tokens equal to the non-speculative ones."""

from __future__ import annotations

import random

import pytest

from tests.support.tiny_models import TINY_VOCAB, save_tiny_llama
from vmesh.services.common.tokenizer import load_chat_tokenizer
from vmesh.services.common.types import SamplingParams
from vmesh.services.engine.llm import EngineConfig, LLMEngine
from vmesh.services.speculative.config import SpeculativeConfig
from vmesh.services.worker.model_runner import ModelRunner, WorkerConfig
from vmesh.services.worker.persistent_batch import PersistentBatch

NGRAM = SpeculativeConfig("ngram", 4, prompt_lookup_min=1, prompt_lookup_max=3)
SUFFIX = SpeculativeConfig("suffix", 4)


def _engine(runner, tokenizer, speculative, *, depth, num_blocks=None):
    runner.batch = PersistentBatch(runner.batch.max_num_reqs, runner.max_model_len, runner.kv_cache.block_size,
                                   runner.model.device, runner.kv_cache.num_blocks, runner.batch.grammar_tokenizer)
    runner.last_step = -1
    runner.speculative = speculative
    saved = runner.kv_cache.num_blocks
    if num_blocks is not None:
        runner.kv_cache.num_blocks = num_blocks  # the scheduler hands out only the first num_blocks
    try:
        return LLMEngine(runner, tokenizer, EngineConfig(pipeline_depth=depth))
    finally:
        runner.kv_cache.num_blocks = saved


@pytest.fixture(scope="module")
def tiny_runner(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(path)
    return ModelRunner.load(WorkerConfig(model=str(path), kv_cache_memory=8 << 20, max_num_seqs=16))


@pytest.fixture(scope="module")
def tiny_prompts():
    rng = random.Random(0)
    shared = [rng.randrange(TINY_VOCAB) for _ in range(40)]  # a prefix several prompts share: cache hits
    prompts = []
    for i in range(10):
        pattern = [rng.randrange(TINY_VOCAB) for _ in range(5)]
        head = shared if i % 2 else [rng.randrange(TINY_VOCAB) for _ in range(7)]
        prompts.append(head + pattern * 3 + pattern[:2])
    return prompts


def _mixed_params(n: int) -> list[SamplingParams]:
    kinds = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=37, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.4,
                       frequency_penalty=0.2),
        SamplingParams(temperature=0, max_tokens=40, min_tokens=12, stop_token_ids=[7, 11, 19, 23, 42]),
        SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=33, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=3),
    ]
    return [kinds[i % len(kinds)] for i in range(n)]


@pytest.mark.parametrize("depth", [1, 2])
def test_speculation_changes_no_token_with_preemption_and_prefix_hits(tiny_runner, embedded_tokenizer,
                                                                       tiny_prompts, depth):
    params = _mixed_params(len(tiny_prompts))
    baseline = _engine(tiny_runner, embedded_tokenizer, None, depth=depth)
    expected = baseline.generate(tiny_prompts, params)
    baseline.shutdown()
    for speculative in (NGRAM, SUFFIX):
        engine = _engine(tiny_runner, embedded_tokenizer, speculative, depth=depth, num_blocks=24)
        outputs = engine.generate(tiny_prompts, params)
        scheduler = engine.scheduler
        assert scheduler.num_preemptions > 0, "the small pool should force preemption"
        assert scheduler.pool.prefix_hits > 0
        # A random model seldom repeats itself, so few drafts are right: the copy test below has the
        # high acceptance; this one has the preemptions, prefix hits and parameter mix.
        assert scheduler.spec_stats.num_draft_tokens > 0
        for i, (got, want) in enumerate(zip(outputs, expected)):
            assert got.token_ids == want.token_ids, f"{speculative.method}, prompt {i}"
            assert got.finish_reason == want.finish_reason
            assert len(got.token_ids) <= params[i].max_tokens
            for mine, theirs in zip(got.logprobs, want.logprobs, strict=True):
                assert mine.top_token_ids == theirs.top_token_ids and mine.rank == theirs.rank
                assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
        assert scheduler.pool.num_free == scheduler.pool.num_blocks, "every KV block is back in the pool"
        engine.shutdown()


def test_recent_outputs_propose_an_answer_given_before(tiny_runner, embedded_tokenizer, tiny_prompts):
    """The suffix method with a cache of recent outputs: asked the same prompts again, the rows
    find their earlier answers in the cache (their own prompts do not hold them) and most drafts
    are accepted, where without the cache few are; outputs stay those of plain decoding."""
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)] * len(tiny_prompts)
    baseline = _engine(tiny_runner, embedded_tokenizer, None, depth=2)
    expected = [out.token_ids for out in baseline.generate(tiny_prompts, params)]
    baseline.shutdown()
    accepted = {}
    for cached in (0, 16):
        engine = _engine(tiny_runner, embedded_tokenizer,
                         SpeculativeConfig("suffix", 4, suffix_decoding_max_cached_requests=cached), depth=2)
        for round_ in ("first", "again"):
            before = engine.scheduler.spec_stats.num_accepted_tokens
            assert [out.token_ids for out in engine.generate(tiny_prompts, params)] == expected, (cached, round_)
            accepted[cached, round_] = engine.scheduler.spec_stats.num_accepted_tokens - before
        assert engine.scheduler.pool.num_free == engine.scheduler.pool.num_blocks
        engine.shutdown()
    # Each of 10 answers has 29 decodes; a repeated answer accepts most of them as drafts.
    assert accepted[16, "again"] >= 0.6 * 29 * len(tiny_prompts), accepted
    assert accepted[16, "again"] > 3 * max(accepted[0, "again"], 1), accepted


COPY_TEXT = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single "
             "step. All that glitters is not gold.")


@pytest.fixture(scope="module")
def embedded_runner(embedded_model_dir):
    return ModelRunner.load(WorkerConfig(model=str(embedded_model_dir), kv_cache_memory=32 << 20, max_num_seqs=8))


@pytest.mark.parametrize("depth", [1, 2])
def test_copying_a_text_accepts_drafts_and_keeps_tokens_and_logprobs(embedded_runner, embedded_model_dir, depth):
    tokenizer = load_chat_tokenizer(embedded_model_dir)
    params = [SamplingParams(temperature=0, max_tokens=40, logprobs=2),  # stops at EOS
              SamplingParams(temperature=0.8, seed=7, max_tokens=40, logprobs=0),
              SamplingParams(temperature=0, max_tokens=9),  # ends inside a run of accepted drafts
              SamplingParams(temperature=0, max_tokens=40, presence_penalty=0.3, frequency_penalty=0.1,
                             repetition_penalty=1.05),
              SamplingParams(temperature=0, max_tokens=40, min_tokens=30)]  # EOS banned at draft positions too
    baseline = _engine(embedded_runner, tokenizer, None, depth=depth)
    prompt = baseline.encode_chat([{"role": "user", "content": "Repeat this text exactly: " + COPY_TEXT}])
    expected = baseline.generate([prompt] * len(params), params)
    baseline.shutdown()
    engine = _engine(embedded_runner, tokenizer, NGRAM, depth=depth)
    outputs = engine.generate([prompt] * len(params), params)
    stats = engine.scheduler.spec_stats
    assert stats.num_accepted_tokens >= stats.num_draft_tokens // 2, stats  # copying: most drafts are right
    for got, want in zip(outputs, expected):
        assert got.token_ids == want.token_ids
        assert [lp.top_token_ids for lp in got.logprobs] == [lp.top_token_ids for lp in want.logprobs]
        assert [lp.logprob for lp in got.logprobs] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-4)
    assert len(outputs[2].token_ids) == 9 and len(outputs[0].token_ids) < 40 and len(outputs[4].token_ids) >= 30
    assert engine.scheduler.pool.num_free == engine.scheduler.pool.num_blocks
    engine.shutdown()


def test_speculation_on_the_triton_backend_changes_no_token(tmp_path, embedded_tokenizer, tiny_prompts):
    """The CUDA path's attention (Triton kernels, interpreted on the CPU here) verifies drafts as
    the C kernels do: rows of 1 + k query tokens over cached context, the KV of accepted drafts
    kept and of rejected ones written over. Negative penalties make the tiny model repeat itself,
    so that drafts are accepted, runs of them included; greedy, at depth 2, token for token and
    logprob for logprob against the same backend without drafts."""
    pytest.importorskip("triton")
    save_tiny_llama(tmp_path)
    runner = ModelRunner.load(WorkerConfig(model=str(tmp_path), kv_cache_memory=4 << 20, max_num_seqs=8,
                                           attention_backend="triton"))
    prompts = tiny_prompts[:3]
    params = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, presence_penalty=-2.0,
                             frequency_penalty=-1.0, logprobs=1)] * len(prompts)
    baseline = _engine(runner, embedded_tokenizer, None, depth=2)
    expected = baseline.generate(prompts, params)
    baseline.shutdown()
    engine = _engine(runner, embedded_tokenizer, NGRAM, depth=2)
    outputs = engine.generate(prompts, params)
    stats = engine.scheduler.spec_stats
    assert stats.num_accepted_tokens > 0 and len(stats.accepted_per_position) > 1, stats
    assert stats.accepted_per_position[1] > 0, "a run of two accepted drafts"
    for got, want in zip(outputs, expected, strict=True):
        assert got.token_ids == want.token_ids
        assert [lp.logprob for lp in got.logprobs] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-4)
    assert engine.scheduler.pool.num_free == engine.scheduler.pool.num_blocks
    engine.shutdown()
