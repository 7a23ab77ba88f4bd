"""Greedy parity with transformers on tiny Llama and Qwen2 checkpoints loaded through the
users' loader: a ragged batch, requests joining late, prefill in chunks."""

from __future__ import annotations

import pytest
import torch

from tests.support.plan_driver import DrivenRequest, drive
from tests.support.reference import assert_greedy_match, hf_greedy
from tests.support.tiny_models import TINY_VOCAB, save_tiny_llama, save_tiny_qwen2
from vmesh.services.worker.model_runner import ModelRunner, WorkerConfig

PROMPT_LENGTHS = (5, 17, 40, 1, 33, 16)


@pytest.mark.parametrize("kind", ["llama", "llama-sharded", "qwen2"])
@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_tiny_model_greedy_parity(tmp_path, kind, block_size, backend):
    if kind == "qwen2":
        reference = save_tiny_qwen2(tmp_path)
    else:
        reference = save_tiny_llama(tmp_path, max_shard_size="100KB" if kind == "llama-sharded" else None)
    if kind == "llama-sharded":
        assert (tmp_path / "model.safetensors.index.json").is_file()
    runner = ModelRunner.load(WorkerConfig(model=str(tmp_path), kv_cache_memory=4 << 20, max_num_seqs=8,
                                           block_size=block_size, attention_backend=backend))
    # auto is the C kernels (attention and fused elementwise ops) wherever a compiler exists, as on CI machines.
    assert runner.backend.name == ("cpu" if backend == "auto" else "torch")
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, TINY_VOCAB, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    requests = [DrivenRequest(p, 24, join_step=2 * i) for i, p in enumerate(prompts)]
    drive(runner, requests, chunk=7)
    for i, r in enumerate(requests):
        assert_greedy_match(r.output, hf_greedy(reference, r.prompt, 24), label=f"{kind} request {i}")
    assert len(runner.batch) == 0


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_tiny_model_greedy_parity_triton_backend(tmp_path, kind):
    """The whole model on the Triton backend (attention, KV writes, fused norms), through the
    interpreter on CPU: still token-for-token equal to transformers."""
    pytest.importorskip("triton")
    reference = save_tiny_qwen2(tmp_path) if kind == "qwen2" else save_tiny_llama(tmp_path)
    runner = ModelRunner.load(WorkerConfig(model=str(tmp_path), kv_cache_memory=4 << 20, max_num_seqs=8,
                                           attention_backend="triton"))
    assert runner.backend.name == "triton"
    generator = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, TINY_VOCAB, (n,), generator=generator).tolist() for n in (9, 21, 2)]
    requests = [DrivenRequest(p, 12, join_step=2 * i) for i, p in enumerate(prompts)]
    drive(runner, requests, chunk=8)
    for i, r in enumerate(requests):
        assert_greedy_match(r.output, hf_greedy(reference, r.prompt, 12), label=f"{kind} triton request {i}")
