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
    # the two repeats of a find its 2 full blocks cached; b and a's first request find nothing
    assert ideal_hit_rate(prompts, 2 * BLOCK_TOKENS) == (2 * 2 * BLOCK_TOKENS) / (4 * 3 * BLOCK_TOKENS)
