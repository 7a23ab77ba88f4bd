"""Rejection sampling keeps the target distribution: a tiny model verifies the same two-token
draft on 4,096 unseeded rows at temperature 1. Every row's first token must be distributed as the
model's p0 (with the draft x0 accepted at rate p0(x0)) and, on rows that accepted x0, the second
as p1 = p(. | prompt, x0). Bound: each estimate within 5 standard errors of the exact probability
(plus 0.002 for float noise), for every token of probability >= 0.01: with ~30 such tokens the
chance of a false failure is below 1e-5, and the draws are seeded, so the outcome is fixed."""

from __future__ import annotations

import pytest
import torch

from tests.support.tiny_models import save_tiny_llama
from vmesh.services.common.step_types import NewRequest, StepPlan
from vmesh.services.common.types import SamplingParams
from vmesh.services.speculative.config import SpeculativeConfig
from vmesh.services.worker import persistent_batch
from vmesh.services.worker.model_runner import ModelRunner, WorkerConfig

ROWS, ROUNDS = 256, 16
PROMPT = [5, 17, 250, 3, 99, 41, 8, 120, 64, 2, 77, 19]


def _close(count: int, total: int, p: float) -> bool:
    return abs(count / total - p) <= 5 * (p * (1 - p) / total) ** 0.5 + 0.002


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    reference = save_tiny_llama(path)
    runner = ModelRunner.load(WorkerConfig(model=str(path), kv_cache_memory=16 << 20, max_num_seqs=ROWS))
    return reference, runner


def _probs(reference, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference(torch.tensor([tokens])).logits[0, -1].float().softmax(-1)


def test_verified_drafts_keep_the_target_distribution(tiny, monkeypatch):
    reference, runner = tiny
    p0 = _probs(reference, PROMPT)
    x0 = int(p0.argmax())
    p1 = _probs(reference, [*PROMPT, x0])
    x1 = int(p1.argmax())
    assert 0.05 < float(p0[x0]) < 0.95, "a draft that is sometimes right, sometimes not"

    def fixed_drafts(config, tokens, lengths, max_drafts, recent=None):
        return torch.tensor([[x0, x1]] * len(lengths)), torch.full((len(lengths),), 2)

    monkeypatch.setattr(persistent_batch, "propose", fixed_drafts)
    runner.speculative = SpeculativeConfig("ngram", 2)
    torch.manual_seed(0)
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    first, second = torch.zeros(p0.shape[0], dtype=torch.int64), torch.zeros(p0.shape[0], dtype=torch.int64)
    for _ in range(ROUNDS):
        runner.reset()
        handles = list(range(ROWS))
        runner.execute(StepPlan(step=0, new_requests=[NewRequest(h, PROMPT, len(PROMPT), params, [h]) for h in handles],
                                scheduled_handles=handles, num_scheduled_tokens=[len(PROMPT) - 1] * ROWS))
        result = runner.execute(StepPlan(step=1, scheduled_handles=handles, num_scheduled_tokens=[1] * ROWS,
                                         num_draft_slots=[2] * ROWS))
        assert result.num_draft_tokens == [2] * ROWS
        offset = 0
        for count in result.num_sampled_tokens:
            tokens = result.sampled_token_ids[offset:offset + count]
            offset += count
            first[tokens[0]] += 1
            assert (count > 1) == (tokens[0] == x0), "a draft is kept exactly when the sample agrees with it"
            if count > 1:
                second[tokens[1]] += 1
    total = ROWS * ROUNDS
    for token in torch.nonzero(p0 >= 0.01).squeeze(1).tolist():
        assert _close(int(first[token]), total, float(p0[token])), (token, int(first[token]), float(p0[token]))
    accepted = int(first[x0])
    assert accepted == int(second.sum())
    for token in torch.nonzero(p1 >= 0.01).squeeze(1).tolist():
        assert _close(int(second[token]), accepted, float(p1[token])), (token, int(second[token]), float(p1[token]))
    runner.speculative = None
    runner.reset()
