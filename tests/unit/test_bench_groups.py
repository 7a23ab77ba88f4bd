"""The hot-prefix workload of `vmesh bench serving --workload hot-prefix`: its shape, and the
ideal hit rate its runs are read against."""

from __future__ import annotations

from vmesh.services.bench.groups import BLOCK_TOKENS, hot_prefix_workload, ideal_hit_rate


def test_the_hot_prefix_workload_has_one_hot_prefix_and_distinct_questions():
    prompts = hot_prefix_workload(400, prefixes=8, prefix_tokens=64, hot_share=0.4, question_tokens=16)
    heads = [tuple(p[:64]) for p in prompts]
    hot = max(set(heads), key=heads.count)
    assert 0.33 < heads.count(hot) / len(prompts) < 0.47
    assert len(set(heads)) == 8
    assert len({tuple(p[64:]) for p in prompts}) == len(prompts)  # every question its own
    assert all(len(p) == 80 for p in prompts)
    assert prompts == hot_prefix_workload(400, prefixes=8, prefix_tokens=64, hot_share=0.4, question_tokens=16)


def test_ideal_hit_rate_counts_each_prefix_computed_once():
    a, b = list(range(2 * BLOCK_TOKENS)), list(range(100, 100 + 2 * BLOCK_TOKENS))
    question = list(range(1000, 1000 + BLOCK_TOKENS))
    prompts = [a + question, a + question, b + question, a + question]
    # each prompt looks up its 2 prefix blocks and its question's block (the last token is always
    # computed, so a 3-block prompt looks up (48 - 1) // 16 = 2 blocks); the repeats of a find 2 each
    assert ideal_hit_rate(prompts, 2 * BLOCK_TOKENS) == (2 + 2) / (4 * 2)
