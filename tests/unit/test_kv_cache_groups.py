"""KV cache groups: the layout of layers into groups, one block table per group per request,
sliding-window groups freeing the blocks behind their window, and the hybrid prefix-cache rule.
The stub worker keeps a KV memory and checks that every position a step's queries see, in every
group, holds the request's own token (tests/support/stub_worker.py)."""

from __future__ import annotations

import random
from collections import Counter, deque

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.factories import make_scheduler
from tests.support.stub_worker import StubWorker, reference_tokens
from vmesh.services.common.kv_cache_groups import kv_cache_layout
from vmesh.services.common.types import SamplingParams
from vmesh.services.scheduler.block_pool import BlockPool
from vmesh.services.scheduler.kv_cache_manager import NO_BLOCK, KVCacheManager
from vmesh.services.scheduler.pipeline import StepPipeline
from vmesh.services.scheduler.request import Request
from vmesh.services.scheduler.scheduler import Scheduler

BLOCK = 4
GEMMA3_WINDOWS = [512 if (i + 1) % 6 else None for i in range(18)]  # 5 local : 1 global, window 512


def test_gemma3_layout_groups_its_layers_three_to_a_block():
    layout = kv_cache_layout(GEMMA3_WINDOWS, 32768)
    assert layout.windows == (None, 512, 512, 512, 512, 512)
    assert layout.groups[0].layers == (5, 11, 17)
    assert [group.layers for group in layout.groups[1:]] == [(0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13),
                                                             (14, 15, 16)]
    assert layout.slots_per_block == 3
    owner, slot = layout.group_of_layer(), layout.slot_of_layer()
    for g, group in enumerate(layout.groups):
        assert [owner[layer] for layer in group.layers] == [g] * 3
        assert [slot[layer] for layer in group.layers] == [0, 1, 2]


def test_a_window_as_long_as_the_context_is_global_and_kinds_of_unequal_size_share_a_page():
    assert kv_cache_layout(GEMMA3_WINDOWS, 512).windows == (None,)  # the window sees every position
    assert kv_cache_layout([7] * 4, 64).windows == (7,)  # Mistral: every layer windowed, one group
    uneven = kv_cache_layout([None] * 5 + [16] * 3, 64)
    assert [group.layers for group in uneven.groups] == [(0, 1, 2), (3, 4), (5, 6, 7)]
    assert uneven.slots_per_block == 3  # the global group of two leaves a slot of its blocks unused


def _manager(num_blocks: int, windows: tuple[int | None, ...]) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks, BLOCK, hash_seed=0, num_groups=len(windows)), windows)


def test_a_window_group_frees_exactly_the_blocks_behind_its_window():
    kv = _manager(32, (None, 8))
    tables = kv.empty_tables()
    assert kv.allocate(tables, 6) is not None and kv.pool.num_free == 32 - 12
    # The next query at position 13 sees 6..13: blocks 0 (0-3) goes, block 1 (4-7) stays.
    assert kv.free_behind_windows(tables, 13) == 1
    assert tables.skipped == [0, 1] and tables.ids[1][0] == NO_BLOCK and kv.pool.num_free == 32 - 11
    assert kv.free_behind_windows(tables, 13) == 0  # nothing twice
    assert kv.free_behind_windows(tables, 24) == 3 and tables.skipped == [0, 4]  # 17..24 seen: blocks 4, 5 kept
    kv.free(tables)
    assert kv.pool.num_free == 32


def _computed_blocks(kv: KVCacheManager, tokens: list[int]) -> tuple[list[int], object]:
    """Blocks for `tokens` in every group, registered as a finished request leaves them."""
    hashes = kv.pool.hash_blocks(tokens)
    tables = kv.empty_tables()
    kv.allocate(tables, len(hashes))
    for i, h in enumerate(hashes):
        kv.register(tables, i, h, hashes[i - 1] if i else None, tokens[i * BLOCK:(i + 1) * BLOCK])
    return hashes, tables


def test_a_prefix_hit_needs_the_global_prefix_and_only_the_window_group_blocks_in_the_window():
    kv = _manager(64, (None, 8))
    tokens = list(range(1, 26))  # 6 full blocks
    hashes, tables = _computed_blocks(kv, tokens)
    kv.free(tables)
    window_blocks = tables.ids[1]
    # Evict the window group's first blocks: a hit of 6 blocks (next position 24) sees 17..24,
    # blocks 4 and 5 only, so it still hits whole.
    for block in window_blocks[:4]:
        kv.pool._forget(block)
    hit = kv.cached_prefix(tokens, hashes)
    assert len(hit) == 6 and hit.skipped == [0, 4] and hit.ids[1][4:] == window_blocks[4:]
    assert hit.ids[0] == tables.ids[0] and hit.ids[1][:4] == [NO_BLOCK] * 4
    kv.free(hit)
    # Without the window group's block 5, the longest hit is 5 blocks (position 20 sees 13..20: blocks 3, 4)
    # but block 3 is gone too: then 4 blocks would need blocks 2, 3; gone: the hit falls to what is whole.
    kv.pool._forget(window_blocks[5])
    assert len(kv.cached_prefix(tokens, hashes)) == 0
    assert kv.pool.num_free == 64  # a miss takes nothing


def test_the_window_hit_is_the_longest_whose_visible_window_blocks_are_cached():
    kv = _manager(64, (None, 8))
    tokens = list(range(1, 26))
    hashes, tables = _computed_blocks(kv, tokens)
    kv.free(tables)
    kv.pool._forget(tables.ids[1][5])  # 6 blocks would need block 5; 5 blocks need blocks 3, 4: cached
    hit = kv.cached_prefix(tokens, hashes)
    assert len(hit) == 5 and hit.skipped == [0, 3] and hit.ids[1][3:] == tables.ids[1][3:5]
    assert kv.pool.prefix_hits == 5 and kv.pool.prefix_queries == 6


def check_invariants(scheduler: Scheduler) -> None:
    pool, kv = scheduler.pool, scheduler.kv
    held = Counter(b for r in scheduler.requests.values() for b in r.block_ids)
    for block in range(pool.num_blocks):
        assert pool.ref_counts[block] == held[block], f"block {block}: ref {pool.ref_counts[block]} != {held[block]}"
    for r in scheduler.requests.values():
        tables = r.tables
        assert len({len(t) for t in tables.ids}) == 1, "every group's table covers the same positions"
        for g, window in enumerate(kv.windows):
            # Nothing the next query (after the surely computed tokens) may see was given back.
            sure = r.num_computed_tokens - sum(r.draft_slots_in_flight)
            assert tables.skipped[g] <= kv.first_visible_block(window, sure)
            if window is None:
                assert tables.skipped[g] == 0


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), windows=st.sampled_from([(None, 6, 6), (5,), (None, 9), (None,)]),
       depth=st.sampled_from([1, 2]))
def test_random_workload_with_window_groups_reads_only_its_own_tokens_and_leaks_nothing(seed, windows, depth):
    rng = random.Random(seed)
    num_blocks = rng.randint(24, 80)
    scheduler = make_scheduler(num_blocks=num_blocks, block_size=BLOCK, max_model_len=64, max_num_seqs=5,
                               max_num_batched_tokens=rng.randint(4, 24), hash_seed=seed, kv_cache_windows=windows)
    worker = StubWorker(num_blocks, BLOCK, windows=windows)
    pipeline = StepPipeline(scheduler, depth)
    in_flight: deque = deque()
    shared_prefix = [rng.randrange(1, 97) for _ in range(30)]
    expected: dict[str, list[int]] = {}
    outputs: dict[str, list[int]] = {}
    for i in range(rng.randint(4, 14)):
        prompt = shared_prefix[:rng.randint(0, 30)] if rng.random() < 0.6 else []
        prompt += [rng.randrange(1, 97) for _ in range(rng.randint(1, 14))]
        prompt = prompt[:scheduler.max_model_len - 1]  # the context the pool can hold for one request
        max_tokens = rng.randint(1, 20)
        scheduler.add_request(Request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=max_tokens)))
        room = scheduler.max_model_len - len(prompt)
        expected[f"r{i}"], outputs[f"r{i}"] = reference_tokens(prompt, min(max_tokens, room)), []
        for _ in range(rng.randint(0, 6)):  # some steps between arrivals, so later prompts hit the cache
            in_flight.extend(worker.execute(plan) for plan in pipeline.plans())
            if in_flight:
                for update in pipeline.complete(in_flight.popleft()):
                    outputs[update.request_id] += update.new_token_ids
            check_invariants(scheduler)
    for _ in range(5000):
        in_flight.extend(worker.execute(plan) for plan in pipeline.plans())
        if not in_flight:
            break
        for update in pipeline.complete(in_flight.popleft()):
            outputs[update.request_id] += update.new_token_ids
        check_invariants(scheduler)
    assert outputs == expected
    assert not scheduler.has_unfinished() and scheduler.pool.num_free == num_blocks
    assert worker.positions_checked > 0


def test_a_long_request_holds_its_window_in_window_groups_and_everything_in_global_ones():
    windows = (None, 16, 16, 16, 16, 16)  # Gemma 3's shape: one global group to five local ones
    scheduler = make_scheduler(num_blocks=1024, block_size=BLOCK, max_model_len=512, max_num_batched_tokens=32,
                               kv_cache_windows=windows)
    worker = StubWorker(1024, BLOCK, windows=windows)
    prompt = [random.Random(1).randrange(1, 97) for _ in range(300)]
    scheduler.add_request(Request("long", prompt, SamplingParams(temperature=0, max_tokens=40)))
    request = scheduler.requests["long"]
    most_held = 0
    outputs: list[int] = []
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        assert plan is not None
        if "long" in scheduler.requests:
            most_held = max(most_held, len(request.block_ids))
            held_at_end = len(request.block_ids)
            entries = len(request.tables)
        for update in scheduler.update(worker.execute(plan)):
            outputs += update.new_token_ids
    assert outputs == reference_tokens(prompt, 40)
    # At 339 tokens every group's table has 85 entries: all-global, 6 x 85 blocks would be held.
    assert entries == -(-339 // BLOCK)
    # The global group holds them all; each window group its 16 positions (the step's included):
    # 5 blocks at most of a decode, and during a 32-token chunk the chunk's 8 more.
    assert held_at_end <= entries + 5 * 5
    assert most_held <= entries + 5 * (-(-(16 - 1 + 32) // BLOCK) + 1)
    assert scheduler.pool.num_free == 1024


def test_a_hit_shortened_by_one_window_group_is_checked_again_by_the_others():
    kv = _manager(64, (None, 8, 8))
    tokens = list(range(1, 26))
    hashes, tables = _computed_blocks(kv, tokens)
    kv.free(tables)
    kv.pool._forget(tables.ids[1][3])  # group 1 serves 6 blocks (they see blocks 4, 5), not 5 or 4 (3 is gone)
    kv.pool._forget(tables.ids[2][5])  # group 2 serves 5 blocks at most (blocks 3, 4)
    hit = kv.cached_prefix(tokens, hashes)  # 5 fails group 1 again: 3 blocks (blocks 1, 2) suit both
    assert len(hit) == 3 and hit.skipped == [0, 1, 1]
    assert hit.ids[1][1:] == tables.ids[1][1:3] and hit.ids[2][1:] == tables.ids[2][1:3]
    kv.free(hit)
    assert kv.pool.num_free == 64
