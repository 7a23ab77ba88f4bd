"""Factories shared by the tests: each builds its object the way the product does."""

from __future__ import annotations

import torch

from vmesh.services.scheduler.scheduler import Scheduler, WorkerGeometry
from vmesh.services.scheduler.settings import DEFAULT_MAX_PREFILL_TOKENS_WITH_DECODES, SchedulerSettings
from vmesh.services.worker.sampler import NO_LOGPROBS, SamplingBatch


def make_scheduler(*, num_blocks: int, block_size: int = 4, max_model_len: int = 256, max_num_seqs: int = 8,
                   max_num_batched_tokens: int = 64, policy: str = "fcfs", max_waiting: int | None = None,
                   eos_token_ids: tuple[int, ...] = (), hash_seed: int | None = None,
                   num_speculative_tokens: int = 0, speculative_disable_by_batch_size: int = 0,
                   max_prefill_tokens_with_decodes: int = DEFAULT_MAX_PREFILL_TOKENS_WITH_DECODES,
                   max_loras: int = 0, kv_cache_windows: tuple[int | None, ...] = (None,)) -> Scheduler:
    """A scheduler core for a worker of this geometry, through the product's one factory. The
    waiting queue is unbounded unless `max_waiting` says otherwise (the service bounds it)."""
    settings = SchedulerSettings(max_num_batched_tokens=max_num_batched_tokens, policy=policy, max_waiting=max_waiting,
                                 max_prefill_tokens_with_decodes=max_prefill_tokens_with_decodes)
    worker = WorkerGeometry(max_model_len=max_model_len, max_num_seqs=max_num_seqs, num_kv_blocks=num_blocks,
                            block_size=block_size, eos_token_ids=eos_token_ids,
                            num_speculative_tokens=num_speculative_tokens,
                            speculative_disable_by_batch_size=speculative_disable_by_batch_size, max_loras=max_loras,
                            kv_cache_windows=kv_cache_windows)
    return Scheduler.for_worker(settings, worker, hash_seed=hash_seed)


def make_sampling_batch(n: int, **columns) -> SamplingBatch:
    """A sampler batch of `n` rows with every parameter at its neutral value, but for `columns`."""
    base = dict(temperature=torch.ones(n), top_k=torch.full((n,), -1, dtype=torch.int64), top_p=torch.ones(n),
                min_p=torch.zeros(n), repetition_penalty=torch.ones(n), presence_penalty=torch.zeros(n),
                frequency_penalty=torch.zeros(n), num_logprobs=torch.full((n,), NO_LOGPROBS),
                generators=[None] * n, seeds=[None] * n, positions=[0] * n)
    base.update(columns)
    return SamplingBatch(**base)
