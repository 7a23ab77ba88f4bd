from __future__ import annotations

import numpy as np
import torch

from tests.support.factories import make_sampling_batch
from vmesh.services.worker.sampler import (
    CANDIDATES,
    DRAW_BLOCK,
    Sampler,
    apply_penalties,
    argmax_rows,
    inverse_transform,
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


def reference_kept(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """What top-k then top-p keep, row by row from whole sorted rows in float64 numpy: k-th
    largest and ties kept; then the nucleus over the top-k-restricted row, through the token
    that crosses top_p."""
    kept = []
    for row, k, p in zip(logits.double().numpy(), top_k.tolist(), top_p.tolist()):
        ranked = np.sort(row)[::-1]
        threshold = -np.inf
        if k > 0:
            threshold = ranked[min(k, len(row)) - 1]
            ranked = np.where(ranked >= threshold, ranked, -np.inf)
        if p < 1.0:
            probs = np.exp(ranked - ranked[0])
            probs /= probs.sum()
            inside = max(1, int(((np.cumsum(probs) - probs) < p).sum()))
            threshold = max(threshold, ranked[inside - 1])
        kept.append(row >= threshold)
    return torch.from_numpy(np.stack(kept))


def test_top_k_and_top_p_keep_what_sorting_whole_rows_keeps():
    """A real vocabulary, against whole rows sorted in float64: batches with top-p alone (a top_p
    of 1 beside them), top-k alone and both; rows peaked and flat (a flat row's nucleus reaches
    past the candidates), 40 tied maxima, a k past the candidates, rows with neither."""
    vocab, rows = 49152, 12
    torch.manual_seed(3)
    spread = torch.tensor([8.0, 8.0, 4.0, 4.0, 2.0, 0.05, 8.0, 0.05, 4.0, 8.0, 1.0, 3.0])
    logits = torch.randn(rows, vocab) * spread[:, None]
    logits[9, :40] = logits[9].max() + 1.0  # 40 tied maxima: top-k 10 and top-p keep them all
    top_k = torch.tensor([-1, 40, -1, 7, -1, -1, 3, 2 * CANDIDATES, 10, 10, -1, -1])
    top_p = torch.tensor([0.9, 1.0, 0.95, 0.5, 0.99, 0.9, 0.3, 1.0, 0.8, 0.2, 1.0, 0.7])
    no_k, no_p, min_p = torch.full((rows,), -1), torch.ones(rows), torch.zeros(rows)
    for k, p in ((top_k, top_p), (no_k, top_p), (top_k, no_p)):
        kept = restrict_logits(logits, k, p, min_p) > float("-inf")
        assert torch.equal(kept, reference_kept(logits, k, p)), (k.tolist(), p.tolist())
    counts = (restrict_logits(logits, no_k, top_p, min_p) > float("-inf")).sum(dim=-1)
    # Top-p alone: peaked rows keep a few tokens, a flat row more than the candidates, top_p 1 all.
    assert counts[0] < 100 and counts[5] > CANDIDATES and counts[1] == vocab and counts[9] == 40
    counts = (restrict_logits(logits, top_k, no_p, min_p) > float("-inf")).sum(dim=-1)
    assert counts.tolist() == [vocab if k < 1 else 40 if i == 9 else k for i, k in enumerate(top_k.tolist())]


def test_a_top_p_request_samples_beyond_its_argmax_beside_neighbours_without_limits():
    logits = torch.tensor([[3.0, 2.9, 2.8, 0.0]] * 2)  # token 3: p = 0.018 for the row without limits
    batch = make_sampling_batch(2, top_p=torch.tensor([0.9, 1.0]))
    seen = torch.zeros(2, 4, dtype=torch.bool)
    torch.manual_seed(5)
    for _ in range(1000):
        seen[torch.arange(2), Sampler()(logits, batch).token_ids] = True
    assert seen[0].tolist() == [True, True, True, False] and seen[1].all()


def test_uniforms_at_either_end_never_hand_the_draw_to_a_token_outside_the_support(monkeypatch):
    """U = 0 takes the first token of positive weight, not the masked one before it; U just below
    1 the last kept token, not the masked one after it."""
    logits = torch.tensor([[float("-inf"), 0.0, 0.5, float("-inf")]])
    drawn = {}
    for name, value in (("zero", 0.0), ("top", 1.0 - 2.0 ** -53)):
        dtypes = []

        def uniforms(shape, dtype=None, device=None, value=value, dtypes=dtypes):
            dtypes.append(dtype)
            return torch.full(shape if isinstance(shape, tuple) else (shape,), value, dtype=dtype)

        monkeypatch.setattr(torch, "rand", uniforms)
        drawn[name] = Sampler()(logits, make_sampling_batch(1)).token_ids.tolist()
        assert dtypes == [torch.float64]  # a float32 U's 2^-24 grid would starve the rarest tokens
    assert drawn == {"zero": [1], "top": [2]}


def test_a_masked_token_given_an_ulp_by_the_cumulative_sum_is_never_drawn(monkeypatch):
    """A parallel scan (CUDA's cumsum) may leave a weight-0 token an interval of an ulp: here the
    masked last token's cumulative weight is one ulp above the one before it, and U just below 1
    lands there. The draw falls back to the row's argmax."""
    logits = torch.tensor([[float("-inf"), 0.0, 0.5, float("-inf")]])
    summed = torch.tensor([[0.0, 1.0, 2.0, float(np.nextafter(2.0, 3.0))]], dtype=torch.float64)
    monkeypatch.setattr(torch.Tensor, "cumsum", lambda self, dim, dtype=None: summed.clone())
    monkeypatch.setattr(torch, "rand", lambda *args, **kwargs: torch.tensor([1.0 - 2.0 ** -53], dtype=torch.float64))
    assert Sampler()(logits, make_sampling_batch(1)).token_ids.tolist() == [2]


def test_draws_are_the_inverse_cdf_of_a_float64_reference(monkeypatch):
    """Rows of a real vocabulary (plain, top-k, top-p, min-p, a seeded one) against float64 numpy:
    the first token whose cumulative probability exceeds the row's uniform. A row with every token
    masked has nothing to draw and keeps its argmax (0), as a greedy row does; the caller's logits
    are left as they were."""
    vocab, rows = 49152, 8
    torch.manual_seed(4)
    logits = torch.randn(rows, vocab) * torch.tensor([3.0, 1.0, 5.0, 3.0, 0.5, 2.0, 2.0, 3.0])[:, None]
    logits[5] = float("-inf")
    before = logits.clone()
    temperature = torch.tensor([0.8, 1.0, 1.3, 0.7, 0.9, 1.0, 1.0, 0.0])
    top_k = torch.tensor([-1, 50, -1, -1, -1, -1, -1, -1])
    top_p = torch.tensor([1.0, 1.0, 0.9, 1.0, 1.0, 1.0, 1.0, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.05, 0.0])
    uniform = torch.rand(rows, dtype=torch.float64)
    monkeypatch.setattr(torch, "rand", lambda *args, **kwargs: uniform.clone())
    generators = [None, None, None, torch.Generator(), None, None, None, None]
    seeds = [None, None, None, 9, None, None, None, None]
    positions = [0, 0, 0, 17, 0, 0, 0, 0]
    batch = make_sampling_batch(rows, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                generators=generators, seeds=seeds, positions=positions)
    got = Sampler()(logits, batch).token_ids.tolist()
    assert torch.equal(logits, before)

    from vmesh.services.worker.sampler import _SEED_MIX  # the seeded row's uniform, drawn as the sampler does
    seeded = torch.empty(1, dtype=torch.float64).uniform_(
        generator=torch.Generator().manual_seed((9 * _SEED_MIX + 17) & 0x7FFFFFFFFFFFFFFF))
    uniform[3] = seeded[0]
    scale = torch.where(temperature > 0, temperature, 1.0)  # the greedy row is not checked against it
    kept = reference_kept(logits / scale[:, None], top_k, top_p).numpy()
    for row in (0, 1, 2, 3, 4, 6):
        scaled = logits[row].double().numpy() / float(temperature[row])
        floor = scaled.max() + np.log(float(min_p[row])) if min_p[row] > 0 else -np.inf
        weights = np.where(kept[row] & (scaled >= floor), np.exp(scaled - scaled[kept[row]].max()), 0.0)
        cumulative = np.cumsum(weights / weights.sum())
        assert got[row] == int(np.searchsorted(cumulative, float(uniform[row]), side="right")), row
    assert got[5] == 0 and got[7] == int(logits[7].argmax())


def test_draws_follow_the_distribution():
    """30,000 rows of one distribution, each token's share within 5 standard deviations of its
    probability (seeded, so the test is deterministic); a token of probability 0 never drawn."""
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


def test_the_blockwise_draw_is_the_whole_row_inverse_cdf_across_block_edges():
    """inverse_transform against float64 numpy over whole rows: a vocabulary of two full blocks
    and a partial one, weights zero across whole blocks and at block edges, uniforms at both ends
    and in between. Every draw is the first token whose running sum exceeds U times the total, and
    of positive weight (the float32 block sums move a block's share by ~1e-7 of itself, far from
    deciding any of these draws)."""
    vocab = 2 * DRAW_BLOCK + 952
    torch.manual_seed(7)
    weights = torch.rand(6, vocab)
    weights[1, :DRAW_BLOCK] = 0.0  # a first block of nothing
    weights[2] = 0.0
    # The last token of one block, the first of the next, and the tail's last.
    weights[2, [DRAW_BLOCK - 1, DRAW_BLOCK, vocab - 1]] = 1.0
    weights[3, DRAW_BLOCK:] = 0.0  # nothing after the first block
    weights[4, :vocab - 1] = 0.0  # only the very last token
    weights[5, ::7] = 0.0
    uniforms = [0.0, 1e-9, 0.25, 1 / 3, 0.5, 0.999, 1.0 - 2.0 ** -53]
    for value in uniforms:
        uniform = torch.full((6,), value, dtype=torch.float64)
        got = inverse_transform(weights, uniform).squeeze(1).tolist()
        for row in range(6):
            cumulative = np.cumsum(weights[row].double().numpy())
            want = int(np.searchsorted(cumulative, value * cumulative[-1], side="right"))
            assert got[row] == want and weights[row, got[row]] > 0, (value, row)


def test_blockwise_draws_follow_the_distribution_across_blocks():
    """A vocabulary of three blocks with its mass on tokens at block edges and in the tail: 20,000
    draws, each token's share within 5 standard deviations of its probability, nothing else drawn."""
    vocab = 2 * DRAW_BLOCK + 500
    where = torch.tensor([5, DRAW_BLOCK - 1, DRAW_BLOCK, 2 * DRAW_BLOCK - 1, vocab - 1])
    probs = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05], dtype=torch.float64)
    row = torch.full((vocab,), float("-inf"))
    row[where] = probs.log().float()
    torch.manual_seed(12)
    tokens = torch.cat([Sampler()(row.repeat(5000, 1), make_sampling_batch(5000)).token_ids for _ in range(4)])
    counts = torch.bincount(tokens, minlength=vocab).double()
    n = len(tokens)
    sigma = (n * probs * (1 - probs)).sqrt()
    assert ((counts[where] - n * probs).abs() <= 5 * sigma).all(), counts[where].tolist()
    assert counts.sum() == counts[where].sum()
