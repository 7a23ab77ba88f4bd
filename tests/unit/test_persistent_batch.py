"""Any sequence of diffs leaves the persistent batch producing exactly the step inputs of a
batch built from scratch with the same requests (added in a different order)."""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vmesh.services.common.step_types import NewRequest, StepPlan
from vmesh.services.common.types import SamplingParams
from vmesh.services.worker.persistent_batch import PersistentBatch, PlanError

BLOCK = 4
MAX_LEN = 64


class Shadow:
    """The plain truth about one live request."""

    def __init__(self, handle: int, rng: random.Random):
        n = rng.randint(1, 20)
        self.handle = handle
        self.tokens = [rng.randrange(1000) for _ in range(n)]
        self.num_prompt = n
        self.computed = rng.randint(0, n - 1)
        self.blocks: list[int] = []
        self.sampling = SamplingParams(temperature=rng.choice([0.0, 0.7]), top_k=rng.choice([-1, 5]),
                                       seed=rng.choice([None, 3]))

    def new_request(self) -> NewRequest:
        return NewRequest(self.handle, list(self.tokens), self.num_prompt, self.sampling, list(self.blocks),
                          self.computed)


def grow_blocks(batch: PersistentBatch, shadow: Shadow, next_block: int) -> int:
    while len(shadow.blocks) * BLOCK < len(shadow.tokens):
        batch.append_blocks(shadow.handle, [next_block])
        shadow.blocks.append(next_block)
        next_block += 1
    return next_block


def assert_same_inputs(a: PersistentBatch, b: PersistentBatch, plan: StepPlan) -> None:
    x, y = a.prepare_inputs(plan), b.prepare_inputs(plan)
    for name in ("input_ids", "positions", "logits_indices", "num_scheduled"):
        assert torch.equal(getattr(x, name), getattr(y, name)), name
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        assert torch.equal(getattr(x.attention[0], name), getattr(y.attention[0], name)), name
    for name, column in a.float_params.items():
        assert torch.equal(column[x.rows], b.float_params[name][y.rows]), name
    assert torch.equal(a.top_k[x.rows], b.top_k[y.rows])
    assert [a.seeds[r] for r in x.rows.tolist()] == [b.seeds[r] for r in y.rows.tolist()]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_ops=st.integers(1, 60))
def test_diffs_match_batch_built_from_scratch(seed, num_ops):
    rng = random.Random(seed)
    batch = PersistentBatch(max_num_reqs=8, max_model_len=MAX_LEN, block_size=BLOCK, device=torch.device("cpu"))
    live: dict[int, Shadow] = {}
    next_handle, next_block = 0, 0
    for _ in range(num_ops):
        op = rng.choice(["add", "add", "remove", "blocks", "compute"])
        if op == "add" and len(live) < 8:
            shadow = Shadow(next_handle, rng)
            need = -(-len(shadow.tokens) // BLOCK)
            shadow.blocks = list(range(next_block, next_block + need))
            next_block += need
            batch.apply(StepPlan(step=0, new_requests=[shadow.new_request()]))
            live[next_handle] = shadow
            next_handle += 1
        elif op == "remove" and live:
            handle = rng.choice(list(live))
            batch.apply(StepPlan(step=0, removed_handles=[handle]))
            del live[handle]
        elif op == "blocks" and live:
            handle = rng.choice(list(live))
            if len(live[handle].blocks) < MAX_LEN // BLOCK:
                live[handle].blocks.append(next_block)
                batch.apply(StepPlan(step=0, scheduled_handles=[handle], num_scheduled_tokens=[0],
                                     new_block_ids=[next_block], num_new_blocks=[1]))
                next_block += 1
        elif op == "compute" and live:
            # Compute what is left of some prompts, then append a "sampled" token as the worker does.
            handles = [h for h in live if live[h].computed < len(live[h].tokens)
                       and len(live[h].tokens) < MAX_LEN]
            for h in handles:
                next_block = grow_blocks(batch, live[h], next_block)
            if handles:
                plan = StepPlan(step=0, scheduled_handles=handles,
                                num_scheduled_tokens=[len(live[h].tokens) - live[h].computed for h in handles])
                inputs = batch.prepare_inputs(plan)
                sampled = torch.tensor([rng.randrange(1000) for _ in handles])
                produced = batch.finish_step(inputs, sampled)
                assert produced.all()
                for h, token in zip(handles, sampled.tolist()):
                    live[h].computed = len(live[h].tokens)
                    live[h].tokens.append(token)
    if not live:
        return
    # Each live request gets room for its next token and computes everything it has not yet.
    for shadow in live.values():
        next_block = grow_blocks(batch, shadow, next_block)
    fresh = PersistentBatch(max_num_reqs=8, max_model_len=MAX_LEN, block_size=BLOCK, device=torch.device("cpu"))
    order = list(live.values())
    rng.shuffle(order)
    fresh.apply(StepPlan(step=0, new_requests=[s.new_request() for s in order]))
    schedule = [h for h in live if live[h].computed < len(live[h].tokens)]
    rng.shuffle(schedule)
    if schedule:
        plan = StepPlan(step=0, scheduled_handles=schedule,
                        num_scheduled_tokens=[len(live[h].tokens) - live[h].computed for h in schedule])
        assert_same_inputs(batch, fresh, plan)
    assert sorted(batch.handle_of_row) == sorted(live)
    assert all(batch.handle_of_row[batch.row_of_handle[h]] == h for h in live)


def test_plan_errors_name_the_problem():
    batch = PersistentBatch(max_num_reqs=2, max_model_len=16, block_size=4, device=torch.device("cpu"),
                            num_kv_blocks=8)
    request = NewRequest(5, [1, 2, 3], 3, SamplingParams(), [0])
    batch.add(request)
    for bad, message in [
        (lambda: batch.add(request), "already in the batch"),
        (lambda: batch.remove(9), "unknown request handle 9"),
        (lambda: batch.prepare_inputs(StepPlan(0, scheduled_handles=[5], num_scheduled_tokens=[4])),
         "cannot compute 4 tokens"),
        (lambda: batch.append_blocks(5, list(range(10))), "overflows"),
        (lambda: batch.append_blocks(5, [3, 8]), "block ids 3..8 fall outside the worker's 8 KV blocks"),
        (lambda: batch.add(NewRequest(6, [1], 1, SamplingParams(), [-1])), "fall outside"),
    ]:
        try:
            bad()
        except PlanError as exc:
            assert message in str(exc)
        else:
            raise AssertionError(f"no PlanError for {message}")


def test_each_kv_cache_group_gets_its_own_table_and_slots():
    """A plan's block ids carry each group's entries in turn; a step's metadata, one per group,
    maps each token to its slot in that group's blocks."""
    batch = PersistentBatch(max_num_reqs=2, max_model_len=16, block_size=4, device=torch.device("cpu"),
                            num_kv_blocks=16, num_kv_groups=2)
    batch.apply(StepPlan(0, new_requests=[NewRequest(3, list(range(1, 7)), 6, SamplingParams(), [5, 9, 0, 7])]))
    inputs = batch.prepare_inputs(StepPlan(0, scheduled_handles=[3], num_scheduled_tokens=[6]))
    global_group, window_group = inputs.attention
    assert global_group.block_tables.tolist() == [[5, 9]] and window_group.block_tables.tolist() == [[0, 7]]
    assert global_group.slot_mapping.tolist() == [20, 21, 22, 23, 36, 37]
    assert window_group.slot_mapping.tolist() == [0, 1, 2, 3, 28, 29]
    batch.finish_step(inputs, torch.tensor([42]))
    batch.apply(StepPlan(1, scheduled_handles=[3], num_scheduled_tokens=[1], new_block_ids=[11, 12],
                         num_new_blocks=[1]))
    assert batch.block_table[0, :, :3].tolist() == [[5, 9, 11], [0, 7, 12]]
    try:
        batch.append_blocks(3, [1, 2, 3])
    except PlanError as exc:
        assert "do not split into 2 KV cache groups" in str(exc)
    else:
        raise AssertionError("an odd number of block ids for two groups was accepted")
