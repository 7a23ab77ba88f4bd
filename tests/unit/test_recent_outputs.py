"""The suffix method's cache of recent outputs: matches against a plain Python reference (ring
wrapped or not), eviction by requests and by tokens, a preempted request's output replaced,
proposals that never run into the next output, the choice between a row's own text and the
cache, and the batch recording exactly the outputs of the requests it removes."""

import numpy as np
import pytest
import torch

from tests.support.token_rows import token_rows
from vmesh.services.common.step_types import NewRequest, StepPlan
from vmesh.services.common.types import SamplingParams
from vmesh.services.speculative.config import SpeculativeConfig, parse_speculative_config
from vmesh.services.speculative.proposers import propose
from vmesh.services.speculative.recent_outputs import CANDIDATES, RecentOutputs
from vmesh.services.worker.persistent_batch import PersistentBatch


def _cache(*outputs: list[int], max_requests: int = 8, max_tokens: int | None = None) -> RecentOutputs:
    cache = RecentOutputs(max_requests, max_tokens)
    for key, output in enumerate(outputs):
        cache.add(key, np.array(output))
    return cache


def _matches(cache: RecentOutputs, *seqs: list[int], max_depth: int = 6, k: int = 3):
    tokens, lengths = token_rows(*seqs)
    length, end = cache.longest_matches(tokens.numpy(), lengths.numpy(), max_depth)
    drafts, available = cache.proposals(end, k)
    return length.tolist(), drafts, available.tolist()


def _reference(outputs: list[list[int]], seq: list[int], max_depth: int) -> tuple[int, list[int]]:
    """Plain Python over the kept outputs (oldest first): among the CANDIDATES latest places of
    seq's last token, those another token of the same output follows; the longest run there
    equal to seq's last tokens (the latest on a tie), and what follows it in its output."""
    places = [(o, i) for o, output in enumerate(outputs) for i, token in enumerate(output) if token == seq[-1]]
    best, follow = 0, []
    for o, i in reversed(places[-CANDIDATES:]):  # latest first: a later place wins only if longer
        output = outputs[o]
        if i + 1 == len(output):
            continue
        n = 0
        while n < max_depth and n <= i and n < len(seq) and output[i - n] == seq[-1 - n]:
            n += 1
        if n > best:
            best, follow = n, output[i + 1:]
    return best, follow


def _check_against_reference(cache: RecentOutputs, kept: list[list[int]], seqs: list[list[int]]) -> None:
    lengths, drafts, available = _matches(cache, *seqs)
    for r, seq in enumerate(seqs):
        want_length, want_follow = _reference(kept, seq, 6)
        assert lengths[r] == want_length, (seq, kept)
        if want_length:
            assert available[r] >= min(3, len(want_follow))
            assert drafts[r, :min(3, len(want_follow))].tolist() == want_follow[:3]


@pytest.mark.parametrize("seed", range(6))
def test_longest_matches_agree_with_a_plain_python_reference(seed):
    generator = torch.Generator().manual_seed(seed)
    vocab = 3 if seed % 2 else 6  # a small vocabulary: tokens occur more often than CANDIDATES
    outputs = [torch.randint(0, vocab, (int(n),), generator=generator).tolist()
               for n in torch.randint(2, 40, (6,), generator=generator)]
    seqs = [torch.randint(0, vocab, (int(n),), generator=generator).tolist()
            for n in torch.randint(1, 25, (12,), generator=generator)]
    _check_against_reference(_cache(*outputs), outputs, seqs)


@pytest.mark.parametrize("seed", range(3))
def test_a_wrapped_ring_matches_only_what_it_keeps(seed):
    """Outputs added past the token budget: the ring wraps many times, old outputs leave, and the
    matches are those of the outputs kept, as if they were the only ones ever added."""
    generator = torch.Generator().manual_seed(10 + seed)
    outputs = [torch.randint(0, 5, (int(n),), generator=generator).tolist()
               for n in torch.randint(2, 30, (40,), generator=generator)]
    cache = _cache(*outputs, max_requests=6, max_tokens=80)
    kept: list[list[int]] = []
    for output in outputs:  # what the budget keeps: the newest, at most 6 and 80 tokens with separators
        kept.append(output)
        while len(kept) > 6 or sum(len(o) + 1 for o in kept) > 80:
            kept.pop(0)
    assert len(cache) == len(kept)
    seqs = [torch.randint(0, 5, (int(n),), generator=generator).tolist()
            for n in torch.randint(1, 12, (16,), generator=generator)]
    _check_against_reference(cache, kept, seqs)


def test_a_proposal_stops_at_the_end_of_its_output():
    cache = _cache([1, 2, 3], [7, 8, 9, 10, 11])
    lengths, drafts, available = _matches(cache, [5, 1, 2], [6, 8], k=4)
    assert lengths == [2, 1]
    assert available == [1, 3] and drafts[0, :1].tolist() == [3] and drafts[1, :3].tolist() == [9, 10, 11]
    # The last token of an output predicts nothing: no match ends there.
    assert _matches(cache, [4, 3])[0] == [0]


def test_outputs_leave_by_count_and_by_tokens_and_a_request_keeps_one_output():
    cache = _cache([1, 2, 3], [4, 5, 6], [7, 8, 9], max_requests=2)
    assert len(cache) == 2 and _matches(cache, [1, 2], [4, 5])[0] == [0, 2]
    cache.add(9, np.array([3]))  # one token predicts nothing: not kept
    assert len(cache) == 2
    cache = _cache([1, 2, 3, 4], [5, 6, 7, 8], max_requests=8, max_tokens=9)  # 4 tokens + a separator each
    assert len(cache) == 1 and _matches(cache, [1, 2], [5, 6])[0] == [0, 2]
    cache = _cache(list(range(1, 13)), max_tokens=9)  # longer than the budget: its last 8 tokens
    assert len(cache) == 1 and _matches(cache, [1, 2], [3, 4], [5, 6], [10, 11])[0] == [0, 0, 2, 2]
    # A preempted request's partial output is replaced by its whole output when it leaves again.
    cache = RecentOutputs(8)
    cache.add(3, np.array([20, 21, 22]))
    cache.add(3, np.array([30, 31, 32, 33]))
    assert len(cache) == 1 and _matches(cache, [20, 21], [31, 32])[0] == [0, 2]
    cache.clear()
    assert len(cache) == 0 and _matches(cache, [31, 32])[0] == [0]


def test_propose_takes_the_cache_where_its_match_is_longer():
    config = SpeculativeConfig("suffix", 4, suffix_decoding_max_spec_factor=2.0, suffix_decoding_max_cached_requests=4)
    cache = _cache([10, 11, 12, 13, 14, 15, 16], [20, 21, 22, 23], [40, 41, 42])
    # Row 0: its own text matches "12" once; the cache matches "11 12": the cache's. Row 1: its own
    # "21 22" and the cache's "21 22" tie: its own. Row 2: nothing anywhere. Row 3: the cache's
    # "40 41", whose output holds one more token, not k.
    tokens, lengths = token_rows([12, 5, 11, 12], [21, 22, 7, 21, 22], [30, 31], [9, 40, 41])
    drafts, counts = propose(config, tokens, lengths, torch.tensor([4, 4, 4, 4]), cache)
    assert counts.tolist() == [4, 3, 0, 1]
    assert drafts[0].tolist() == [13, 14, 15, 16]
    assert drafts[1, :3].tolist() == [7, 21, 22]
    assert drafts[3].tolist() == [42, 0, 0, 0]  # never the separator or the next output's tokens
    assert bool((drafts >= 0).all())
    without, counts_without = propose(config, tokens, lengths, torch.tensor([4, 4, 4, 4]))
    assert counts_without.tolist() == [2, 3, 0, 0] and without[0, :2].tolist() == [5, 11]


def test_the_batch_keeps_the_outputs_of_the_requests_it_removes():
    batch = PersistentBatch(4, 64, 16, torch.device("cpu"), num_kv_blocks=8)
    batch.keep_recent_outputs(SpeculativeConfig("suffix", 4, suffix_decoding_max_cached_requests=4))
    params = SamplingParams(temperature=0)
    prompt, outputs = [5, 6, 7, 8], [50, 51, 52, 53]
    batch.apply(StepPlan(step=0, new_requests=[NewRequest(1, prompt + outputs, len(prompt), params, [0])]))
    batch.token_ids[0, 8:11] = torch.tensor([60, 61, 62])  # drafts past the row's known tokens
    batch.apply(StepPlan(step=1, removed_handles=[1]))
    cache = batch.recent_outputs
    assert cache is not None and len(cache) == 1
    lengths, drafts, available = _matches(cache, [50, 51], [7, 8], [52], k=4)
    assert lengths == [2, 0, 1]  # the outputs, not the prompt
    assert available[0] == 2 and drafts[0, :2].tolist() == [52, 53]  # not the drafts after them
    batch.keep_recent_outputs(SpeculativeConfig("suffix", 4))
    assert batch.recent_outputs is None


def test_config_takes_the_cache_size_for_the_suffix_method_only():
    config = parse_speculative_config('{"method": "suffix", "num_speculative_tokens": 4, '
                                      '"suffix_decoding_max_cached_requests": 64}')
    assert config.suffix_decoding_max_cached_requests == 64
    assert SpeculativeConfig("suffix", 4).suffix_decoding_max_cached_requests == 0  # off unless asked
    with pytest.raises(ValueError, match="needs method 'suffix'"):
        SpeculativeConfig("ngram", 4, suffix_decoding_max_cached_requests=8)
    with pytest.raises(ValueError, match="must be in"):
        SpeculativeConfig("suffix", 4, suffix_decoding_max_cached_requests=-1)
