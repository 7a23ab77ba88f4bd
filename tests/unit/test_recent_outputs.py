"""The suffix method's cache of recent outputs: matches against a plain Python reference,
proposals that never run into the next output, and the choice between a row's own text and the
cache."""

import pytest
import torch

from vmesh.services.speculative.config import SpeculativeConfig, parse_speculative_config
from vmesh.services.speculative.proposers import propose
from vmesh.services.speculative.recent_outputs import RecentOutputs


def _rows(*seqs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, seqs)) + 3
    tokens = torch.full((len(seqs), width), 99, dtype=torch.int64)  # junk past each row's tokens
    for r, seq in enumerate(seqs):
        tokens[r, :len(seq)] = torch.tensor(seq)
    return tokens, torch.tensor([len(s) for s in seqs])


def _cache(*outputs: list[int], max_requests: int = 8) -> RecentOutputs:
    cache = RecentOutputs(max_requests)
    for output in outputs:
        cache.add(torch.tensor(output))
    return cache


def _reference(outputs: list[list[int]], seq: list[int], max_depth: int) -> tuple[int, list[int]]:
    """The longest (then latest) run of an output equal to seq's last tokens with a token after
    it in the same output, and what follows it there: plain Python over every place."""
    best, order, follow = 0, -1, []
    place = 0
    for output in outputs:
        for end in range(len(output) - 1):  # a token must follow
            n = 0
            while n < max_depth and n <= end and n < len(seq) and output[end - n] == seq[-1 - n]:
                n += 1
            if n and (n, place) >= (best, order):
                best, order, follow = n, place, output[end + 1:]
            place += 1
    return best, follow


@pytest.mark.parametrize("seed", range(6))
def test_longest_matches_agree_with_a_plain_python_reference(seed):
    generator = torch.Generator().manual_seed(seed)
    outputs = [torch.randint(0, 4, (int(n),), generator=generator).tolist()
               for n in torch.randint(2, 30, (5,), generator=generator)]
    seqs = [torch.randint(0, 4, (int(n),), generator=generator).tolist()
            for n in torch.randint(1, 25, (12,), generator=generator)]
    cache = _cache(*outputs)
    tokens, lengths = _rows(*seqs)
    length, end = cache.longest_matches(tokens, lengths, max_depth=6)
    drafts, available = cache.proposals(end, 3)
    for r, seq in enumerate(seqs):
        want_length, want_follow = _reference(outputs, seq, 6)
        assert int(length[r]) == want_length, (seq, outputs)
        if want_length:
            assert int(available[r]) == len(want_follow)
            assert drafts[r, :min(3, len(want_follow))].tolist() == want_follow[:3]


def test_a_proposal_stops_at_the_end_of_its_output():
    cache = _cache([1, 2, 3], [7, 8, 9, 10, 11])
    tokens, lengths = _rows([5, 1, 2], [6, 8])
    length, end = cache.longest_matches(tokens, lengths, max_depth=4)
    drafts, available = cache.proposals(end, 4)
    assert length.tolist() == [2, 1]
    assert available.tolist() == [1, 3] and drafts[0, :1].tolist() == [3] and drafts[1, :3].tolist() == [9, 10, 11]
    # The last token of an output predicts nothing: no match ends there.
    length, _end = cache.longest_matches(*_rows([4, 3]), max_depth=4)
    assert length.tolist() == [0]


def test_the_oldest_output_leaves_a_full_cache():
    cache = _cache([1, 2, 3], [4, 5, 6], [7, 8, 9], max_requests=2)
    assert len(cache) == 2
    length, _end = cache.longest_matches(*_rows([1, 2], [4, 5]), max_depth=4)
    assert length.tolist() == [0, 2]
    cache.add(torch.tensor([3]))  # one token predicts nothing: not kept
    assert len(cache) == 2


def test_propose_takes_the_cache_where_its_match_is_longer():
    config = SpeculativeConfig("suffix", 4, suffix_decoding_max_spec_factor=2.0, suffix_decoding_max_cached_requests=4)
    cache = _cache([10, 11, 12, 13, 14, 15, 16], [20, 21, 22, 23])
    # Row 0: its own text matches "12" once; the cache matches "11 12": the cache's. Row 1: its own
    # "21 22" and the cache's "21 22" tie: its own. Row 2: nothing anywhere.
    tokens, lengths = _rows([12, 5, 11, 12], [21, 22, 7, 21, 22], [30, 31])
    drafts, counts = propose(config, tokens, lengths, torch.tensor([4, 4, 4]), cache)
    assert counts.tolist() == [4, 3, 0]
    assert drafts[0].tolist() == [13, 14, 15, 16]
    assert drafts[1, :3].tolist() == [7, 21, 22]
    without, counts_without = propose(config, tokens, lengths, torch.tensor([4, 4, 4]))
    assert counts_without.tolist() == [2, 3, 0] and without[0, :2].tolist() == [5, 11]


def test_config_takes_the_cache_size_for_the_suffix_method_only():
    config = parse_speculative_config('{"method": "suffix", "num_speculative_tokens": 4, '
                                      '"suffix_decoding_max_cached_requests": 64}')
    assert config.suffix_decoding_max_cached_requests == 64
    assert SpeculativeConfig("suffix", 4).suffix_decoding_max_cached_requests == 0  # off unless asked
    with pytest.raises(ValueError, match="needs method 'suffix'"):
        SpeculativeConfig("ngram", 4, suffix_decoding_max_cached_requests=8)
    with pytest.raises(ValueError, match="must be in"):
        SpeculativeConfig("suffix", 4, suffix_decoding_max_cached_requests=-1)
