"""Greedy parity with transformers on the embedded SmolLM2: 8 chat prompts of mixed
lengths in one batch, some joining after others started, prefill chunked."""

from __future__ import annotations

import pytest

from tests.support.plan_driver import DrivenRequest, drive
from tests.support.reference import assert_greedy_match
from vmesh.services.worker.model_runner import ModelRunner, WorkerConfig


@pytest.fixture(scope="module")
def runner(embedded_model_dir):
    return ModelRunner.load(WorkerConfig(model=str(embedded_model_dir), kv_cache_memory=64 << 20,
                                         max_num_seqs=16))


def test_embedded_model_mixed_batch_parity(runner, chat_prompt_ids, reference_outputs):
    prompts = chat_prompt_ids[:8]
    assert len({len(p) for p in prompts}) > 1, "prompts should have mixed lengths"
    chunk = 16
    assert all(len(p) > chunk for p in prompts), "prefill must be split into several chunks"
    requests = [DrivenRequest(p, 32, join_step=(i % 4) * 3) for i, p in enumerate(prompts)]
    drive(runner, requests, chunk=chunk, step_offset=runner.last_step + 1)
    for i, r in enumerate(requests):
        assert_greedy_match(r.output, reference_outputs[i], label=f"prompt {i}")
