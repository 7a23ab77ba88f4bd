import pytest
import torch

from tests.support.token_rows import token_rows
from vmesh.services.speculative.config import SpeculativeConfig, parse_speculative_config
from vmesh.services.speculative.proposers import propose, suffix_match_lengths
from vmesh.services.speculative.verification import num_accepted


def _reference_ngram(seq: list[int], lo: int, hi: int, k: int, cap: int) -> list[int]:
    """Per row in plain Python: the longest n in [lo, hi] whose suffix occurred before (latest occurrence)."""
    for n in range(min(hi, len(seq) - 1), lo - 1, -1):
        suffix = seq[-n:]
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start:start + n] == suffix:
                follow = seq[start + n:start + n + min(k, cap)]
                return follow
    return []


def test_suffix_match_lengths_counts_common_suffixes():
    tokens, lengths = token_rows([1, 2, 3, 9, 2, 3])
    matched = suffix_match_lengths(tokens, lengths, 4)
    # ends before the last token: [1]=2 matches "2" only ... [2]=3 matches "2 3"
    assert matched[0].tolist()[:5] == [0, 0, 2, 0, 0]


@pytest.mark.parametrize("seed", range(5))
def test_ngram_matches_a_plain_python_reference(seed):
    generator = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, 4, (int(n),), generator=generator).tolist()
            for n in torch.randint(2, 40, (16,), generator=generator)]
    caps = torch.randint(0, 5, (16,), generator=generator)
    config = SpeculativeConfig("ngram", 4, prompt_lookup_min=2, prompt_lookup_max=3)
    tokens, lengths = token_rows(*seqs)
    drafts, counts = propose(config, tokens, lengths, caps)
    for r, seq in enumerate(seqs):
        expected = _reference_ngram(seq, 2, 3, 4, int(caps[r]))
        assert drafts[r, :counts[r]].tolist() == expected, (seq, int(caps[r]))


def test_no_match_proposes_nothing_and_proposals_stop_at_known_tokens():
    config = SpeculativeConfig("ngram", 4, prompt_lookup_min=2, prompt_lookup_max=3)
    tokens, lengths = token_rows([1, 2, 3, 4, 5], [7, 8, 5, 7, 8])
    drafts, counts = propose(config, tokens, lengths, torch.tensor([4, 4]))
    assert counts.tolist() == [0, 3]  # "7 8" recurs; what followed it: 5, 7, 8 (then the row ends)
    assert drafts[1, :3].tolist() == [5, 7, 8]


def test_suffix_scales_drafts_with_match_length():
    config = SpeculativeConfig("suffix", 8, suffix_decoding_max_spec_factor=1.0)
    tokens, lengths = token_rows([5, 6, 1, 2, 3, 4, 9, 9, 9, 2, 3], [1, 2, 3, 4, 5, 6, 7, 8, 0, 7])
    drafts, counts = propose(config, tokens, lengths, torch.tensor([8, 8]))
    assert counts.tolist() == [2, 1]  # "2 3" matched: two tokens; "7" matched: one
    assert drafts[0, :2].tolist() == [4, 9] and drafts[1, :1].tolist() == [8]


def test_num_accepted_stops_at_the_first_disagreement():
    samples = torch.tensor([[5, 6, 7, 8], [5, 0, 7, 8], [1, 2, 3, 4]])
    drafts = torch.tensor([[5, 6, 7], [5, 6, 7], [1, 2, 3]])
    assert num_accepted(samples, drafts, torch.tensor([3, 3, 1])).tolist() == [3, 1, 1]


def test_config_parses_vllm_keys_and_refuses_unknown_ones():
    config = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, '
                                      '"prompt_lookup_max": 3}')
    assert config == SpeculativeConfig("ngram", 4, prompt_lookup_min=1, prompt_lookup_max=3)
    assert config.disable_by_batch_size == 16  # the measured crossover unless the flag says otherwise
    assert parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4, '
                                    '"disable_by_batch_size": 0}').disable_by_batch_size == 0
    assert parse_speculative_config("") is None
    with pytest.raises(ValueError, match="unknown key"):
        parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4, "model": "x"}')
    with pytest.raises(ValueError, match="num_speculative_tokens must be"):
        parse_speculative_config('{"method": "ngram", "num_speculative_tokens": "4"}')
    with pytest.raises(ValueError, match="speculative method"):
        parse_speculative_config('{"method": "eagle", "num_speculative_tokens": 4}')
