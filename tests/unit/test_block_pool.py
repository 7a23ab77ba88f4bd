"""Block pool invariants under a randomised workload of admissions, steps, preemptions and
aborts: no block leaked or double-freed, ref counts never negative, all free at the end."""

from __future__ import annotations

import random
from collections import Counter, deque

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.factories import make_scheduler
from tests.support.stub_worker import StubWorker
from vmesh.services.common.types import SamplingParams
from vmesh.services.scheduler.block_pool import BlockPool
from vmesh.services.scheduler.pipeline import StepPipeline
from vmesh.services.scheduler.request import Request
from vmesh.services.scheduler.scheduler import Scheduler

BLOCK = 4


def check_invariants(scheduler: Scheduler) -> None:
    pool = scheduler.pool
    assert all(c >= 0 for c in pool.ref_counts)
    held = Counter(b for r in scheduler.requests.values() for b in r.block_ids)
    for block in range(pool.num_blocks):
        assert pool.ref_counts[block] == held[block], f"block {block}: ref {pool.ref_counts[block]} != {held[block]}"
        assert (block in pool.free_blocks) == (pool.ref_counts[block] == 0)
    for h, block in pool.cached.items():
        assert pool.block_hash[block] == h
    for r in scheduler.requests.values():
        assert len(set(r.block_ids)) == len(r.block_ids), "a request holds a block twice"


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_blocks=st.integers(6, 40), depth=st.sampled_from([1, 2]))
def test_random_workload_keeps_pool_consistent(seed, num_blocks, depth):
    rng = random.Random(seed)
    scheduler = make_scheduler(num_blocks=num_blocks, block_size=BLOCK, max_model_len=64, max_num_seqs=6,
                               max_num_batched_tokens=rng.randint(4, 32), eos_token_ids=(0,), hash_seed=seed)
    pool = scheduler.pool
    worker = StubWorker(num_blocks, BLOCK)
    pipeline = StepPipeline(scheduler, depth)
    in_flight: deque = deque()
    shared_prefix = [rng.randrange(1, 97) for _ in range(12)]
    next_id = 0
    for _ in range(rng.randint(5, 80)):
        action = rng.random()
        if action < 0.3:
            prompt_len = rng.randint(1, min(20, (num_blocks - 1) * BLOCK - 1))
            prompt = (shared_prefix if rng.random() < 0.5 else [])[:prompt_len]
            prompt += [rng.randrange(1, 97) for _ in range(prompt_len - len(prompt))]
            scheduler.add_request(Request(f"r{next_id}", prompt, SamplingParams(
                temperature=0, max_tokens=rng.randint(1, 12), ignore_eos=rng.random() < 0.5)))
            next_id += 1
        elif action < 0.45 and scheduler.requests:
            scheduler.abort(rng.choice(list(scheduler.requests)))
        else:
            in_flight.extend(worker.execute(plan) for plan in pipeline.plans())
            if in_flight:
                pipeline.complete(in_flight.popleft())
        check_invariants(scheduler)
    # Drain: everything finishes, every block returns.
    for _ in range(5000):
        in_flight.extend(worker.execute(plan) for plan in pipeline.plans())
        if not in_flight:
            break
        pipeline.complete(in_flight.popleft())
        check_invariants(scheduler)
    assert not scheduler.has_unfinished()
    assert pool.num_free == num_blocks
    assert all(c == 0 for c in pool.ref_counts)
    assert not worker.tokens or scheduler.pending_removals == []


def test_lru_eviction_and_tail_first_free():
    pool = BlockPool(4, BLOCK, hash_seed=0)
    a = pool.allocate(2)
    tokens = list(range(8))
    hashes = pool.hash_blocks(tokens)
    for i, block in enumerate(a):
        pool.register(block, hashes[i], hashes[i - 1] if i else None, tokens[i * 4:(i + 1) * 4])
    pool.free(a)  # tail first: a[1] becomes least recently used... then a[0]
    assert list(pool.free_blocks)[-2:] == [a[1], a[0]]
    # Two fresh blocks come from the never-used ones; the cached blocks survive.
    pool.allocate(2)
    assert pool.evictions == 0 and len(pool.cached) == 2
    # The next allocation evicts the tail block (a[1]) first; the prefix block stays.
    pool.allocate(1)
    assert pool.evictions == 1 and pool.block_hash[a[0]] is not None and pool.block_hash[a[1]] is None
    found = pool.lookup_prefix(tokens, hashes)
    assert found == [a[0]] and pool.prefix_hits == 1 and pool.stats().usage == 1.0


def test_reset_prefix_cache_forgets_only_blocks_nobody_holds():
    pool = BlockPool(6, BLOCK, hash_seed=0)
    tokens = list(range(12))
    hashes = pool.hash_blocks(tokens)
    blocks = pool.allocate(3)
    for i, block in enumerate(blocks):
        pool.register(block, hashes[i], hashes[i - 1] if i else None, tokens[i * 4:(i + 1) * 4])
    pool.free(blocks[1:])  # the first block stays held, as by a running request
    assert pool.reset_prefix_cache() == 2
    assert pool.evictions == 0 and list(pool.cached.values()) == [blocks[0]]
    assert pool.lookup_prefix(tokens, hashes) == [blocks[0]]  # the held prefix still hits
    pool.free([blocks[0], blocks[0]])
    assert pool.reset_prefix_cache() == 1 and not pool.cached and pool.lookup_prefix(tokens, hashes) == []
    assert pool.num_free == 6
