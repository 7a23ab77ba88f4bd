from __future__ import annotations

import torch

from tests.support.factories import make_sampling_batch
from vmesh.services.worker.sampler import (
    CANDIDATES,
    Sampler,
    _keep_thresholds,
    apply_penalties,
    argmax_rows,
    restrict_logits,
)

VOCAB = 50




def test_argmax_rows_is_torch_argmax_on_ties_nans_masked_rows_and_strides():
    inf, nan = float("inf"), float("nan")
    rows = torch.tensor([[1.0, 3.0, 3.0, 2.0], [-inf] * 4, [1.0, nan, 5.0, nan], [2.0] * 4, [-inf, 0.0, inf, inf]])
    wide = torch.randn(9, 4 * VOCAB)
    for scores in (rows, wide, wide[:, ::3], wide.t().contiguous().t(), torch.empty(0, VOCAB)):
        assert torch.equal(argmax_rows(scores), scores.argmax(dim=-1))
    for other in (wide.double(), wide.bfloat16()):  # torch's own path
        assert torch.equal(argmax_rows(other), other.argmax(dim=-1))
    assert argmax_rows(wide).dtype == torch.int64


def test_greedy_and_zero_temperature_take_argmax_without_nan():
    logits = torch.randn(4, VOCAB)
    out = Sampler()(logits, make_sampling_batch(4, temperature=torch.zeros(4)))
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_seeded_rows_do_not_depend_on_batch_neighbours():
    torch.manual_seed(0)
    row = torch.randn(VOCAB)
    sampler = Sampler()

    def sample_in(batch_size: int, at: int, position: int) -> int:
        logits = torch.randn(batch_size, VOCAB)
        logits[at] = row
        generators = [torch.Generator() if i == at else None for i in range(batch_size)]
        seeds = [42 if i == at else None for i in range(batch_size)]
        positions = [position] * batch_size
        batch = make_sampling_batch(batch_size, temperature=torch.full((batch_size,), 0.9), generators=generators,
                           seeds=seeds, positions=positions)
        return int(sampler(logits, batch).token_ids[at])

    for position in range(5):
        tokens = {sample_in(1, 0, position), sample_in(5, 3, position), sample_in(9, 8, position)}
        assert len(tokens) == 1
    # Different positions draw differently (not one fixed token forever).
    assert len({sample_in(1, 0, p) for p in range(40)}) > 1


def test_top_k_top_p_min_p_restrict_support_exactly():
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    logits = probs.log().repeat(4, 1)
    top_k = torch.tensor([2, 0, 0, 0])
    top_p = torch.tensor([1.0, 0.7, 1.0, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.3, 0.0])
    kept = restrict_logits(logits, top_k, top_p, min_p) > float("-inf")
    assert kept[0].tolist() == [True, True, False, False, False, False]
    # Nucleus: 0.4 + 0.25 = 0.65 < 0.7, so the token crossing 0.7 (0.15) is included.
    assert kept[1].tolist() == [True, True, True, False, False, False]
    # min_p 0.3 x 0.4 = 0.12: tokens at 0.15 and above.
    assert kept[2].tolist() == [True, True, True, False, False, False]
    assert kept[3].all()

    # Sampling many times never leaves the support.
    sampler = Sampler()
    batch = make_sampling_batch(4, top_k=top_k, top_p=top_p, min_p=min_p)
    seen = torch.zeros(4, 6, dtype=torch.bool)
    for _ in range(300):
        tokens = sampler(logits, batch).token_ids
        seen[torch.arange(4), tokens] = True
    assert not (seen & ~kept).any()
    assert seen[3].sum() >= 5


def test_top_k_and_top_p_over_the_largest_logits_keep_what_sorting_whole_rows_keeps():
    """A real vocabulary, rows peaked and flat (a flat row's nucleus reaches past the candidates
    and is sorted whole), ties at the threshold, top-k past the candidates, rows with neither."""
    vocab, rows = 49152, 12
    torch.manual_seed(3)
    spread = torch.tensor([8.0, 8.0, 4.0, 4.0, 2.0, 0.05, 8.0, 0.05, 4.0, 8.0, 1.0, 3.0])
    logits = torch.randn(rows, vocab) * spread[:, None]
    logits[9, :40] = logits[9].max() + 1.0  # 40 tied maxima: top-k 10 and top-p keep them all
    top_k = torch.tensor([-1, 40, -1, 7, -1, -1, 3, 500, 10, 10, -1, -1])
    top_p = torch.tensor([0.9, 1.0, 0.95, 0.5, 0.99, 0.9, 0.3, 1.0, 0.8, 0.2, 1.0, 0.7])
    min_p = torch.zeros(rows)
    whole = _keep_thresholds(logits, top_k, top_p, True, True, vocab)[0]
    expected = logits.masked_fill(logits < whole, float("-inf"))
    assert torch.equal(restrict_logits(logits, top_k, top_p, min_p), expected)
    kept = (expected > float("-inf")).sum(dim=-1)
    assert kept[5] > CANDIDATES and kept[9] == 40 and kept[3] <= 7 and kept[10] == vocab  # the cases above
    many = torch.tensor([2 * CANDIDATES] + [-1] * (rows - 1))  # top-k past the candidates: whole rows
    whole = _keep_thresholds(logits, many, top_p, True, True, vocab)[0]
    assert torch.equal(restrict_logits(logits, many, top_p, min_p), logits.masked_fill(logits < whole, float("-inf")))
    only_k = restrict_logits(logits, top_k, torch.ones(rows), min_p) > float("-inf")
    assert only_k.sum(dim=-1).tolist() == [vocab if k < 1 else max(k, 40 if i == 9 else k)
                                           for i, k in enumerate(top_k.tolist())]


def test_draws_follow_the_distribution():
    """The exponential race over q = -log U: 30,000 rows of one distribution, each token's share
    within 5 standard deviations of its probability (seeded, so the test is deterministic)."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    n = 30_000
    torch.manual_seed(11)
    tokens = Sampler()(probs.log().repeat(n, 1), make_sampling_batch(n)).token_ids
    counts = torch.bincount(tokens, minlength=5).double()
    sigma = (n * probs.double() * (1 - probs.double())).sqrt()
    assert ((counts - n * probs.double()).abs() <= 5 * sigma + 1e-9).all(), counts.tolist()
    assert counts[4] == 0


def test_penalties_change_logits_as_defined():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    # prompt has token 0; outputs are tokens 1, 1 and 2.
    seen = torch.tensor([[0, 1, 1, 2]])
    output = torch.tensor([[-1, 1, 1, 2]])
    batch = make_sampling_batch(1, repetition_penalty=torch.tensor([2.0]), presence_penalty=torch.tensor([0.5]),
                       frequency_penalty=torch.tensor([0.25]))
    batch.seen_token_ids, batch.output_token_ids = seen, output
    got = apply_penalties(logits, batch)
    expected = torch.tensor([[2.0 / 2, -1.0 * 2 - 0.5 - 0.25 * 2, 0.5 / 2 - 0.5 - 0.25, 3.0]])
    assert torch.allclose(got, expected)


def test_logprobs_come_from_raw_logits():
    torch.manual_seed(1)
    logits = torch.randn(3, VOCAB)
    batch = make_sampling_batch(3, temperature=torch.tensor([0.0, 0.5, 0.0]), num_logprobs=torch.tensor([3, -1, 0]),
                       repetition_penalty=torch.tensor([1.5, 1.0, 1.0]))
    batch.seen_token_ids = torch.tensor([[int(logits[0].argmax())], [-1], [-1]])
    batch.output_token_ids = torch.full((3, 1), -1)
    out = Sampler()(logits, batch)
    assert out.logprob_rows.tolist() == [0, 2]
    reference = logits.log_softmax(-1)
    for i, row in enumerate([0, 2]):
        token = int(out.token_ids[row])
        assert torch.isclose(out.sampled_logprobs[i], reference[row, token])
        assert int(out.sampled_ranks[i]) == int((reference[row] > reference[row, token]).sum()) + 1
    top = reference[0].topk(3)
    assert torch.allclose(out.top_logprobs[0], top.values)
    assert torch.equal(out.top_token_ids[0], top.indices)
    # The penalty moved row 0's greedy choice off the raw argmax: its rank is then > 1.
    assert int(out.sampled_ranks[0]) > 1
