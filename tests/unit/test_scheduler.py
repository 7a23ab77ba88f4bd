"""The scheduler against a stub worker: chunked prefill, preemption, prefix caching, async
placeholders, stops, aborts and queue policies."""

from __future__ import annotations

from collections import deque

import pytest

from tests.support.factories import make_scheduler
from tests.support.stub_worker import StubWorker, next_token, reference_tokens
from vmesh.services.common.types import FinishReason, SamplingParams
from vmesh.services.scheduler.request import Request
from vmesh.services.scheduler.scheduler import QueueFullError

BLOCK = 4


def make(num_blocks=64, max_num_seqs=8, budget=64, max_model_len=256, policy="fcfs", eos=(), **kw):
    scheduler = make_scheduler(num_blocks=num_blocks, block_size=BLOCK, max_model_len=max_model_len,
                               max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, policy=policy,
                               eos_token_ids=eos, hash_seed=1, **kw)
    return scheduler, StubWorker(num_blocks, BLOCK)


def run(scheduler, worker, depth=2, max_steps=10_000, on_step=None):
    """Drive scheduler and worker like EngineCore does; returns outputs per request id."""
    outputs: dict[str, list[int]] = {}
    finish: dict[str, FinishReason] = {}
    in_flight: deque = deque()
    for _ in range(max_steps):
        while len(in_flight) < depth and (plan := scheduler.schedule()) is not None:
            in_flight.append(worker.execute(plan))
        if not in_flight:
            break
        for update in scheduler.update(in_flight.popleft()):
            outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
            if update.finish_reason:
                finish[update.request_id] = update.finish_reason
        if on_step:
            on_step()
    assert not scheduler.has_unfinished()
    return outputs, finish


def req(i, prompt_len=10, max_tokens=8, **params):
    prompt = [(i * 31 + j * 7) % 90 + 1 for j in range(prompt_len)]
    return Request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=max_tokens, **params))


def assert_all_free(scheduler):
    assert scheduler.pool.num_free == scheduler.pool.num_blocks
    assert all(c == 0 for c in scheduler.pool.ref_counts)


@pytest.mark.parametrize("depth", [1, 2])
def test_outputs_follow_the_model_whatever_the_batching(depth):
    scheduler, worker = make(budget=16)
    requests = [req(i, prompt_len=5 + 3 * i, max_tokens=6 + i) for i in range(6)]
    for r in requests:
        scheduler.add_request(r)
    outputs, finish = run(scheduler, worker, depth)
    for r in requests:
        assert outputs[r.request_id] == reference_tokens(r.prompt_token_ids, r.sampling.max_tokens)
        assert finish[r.request_id] is FinishReason.LENGTH
    # A budget of 16 tokens split the longer prompts across steps.
    assert max(sum(p.num_scheduled_tokens) for p in worker.plans) <= 16
    assert_all_free(scheduler)


def test_chunked_prefill_mixes_with_decodes():
    scheduler, worker = make(budget=8)
    scheduler.add_request(req(0, prompt_len=3, max_tokens=10))
    run_steps = []
    scheduler.add_request(req(1, prompt_len=30, max_tokens=2))
    outputs, _ = run(scheduler, worker, depth=1, on_step=lambda: run_steps.append(1))
    mixed = [p for p in worker.plans if len(p.scheduled_handles) == 2 and 1 in p.num_scheduled_tokens
             and max(p.num_scheduled_tokens) > 1]
    assert mixed, "a prefill chunk and a decode should share a step"
    assert outputs["r1"] == reference_tokens(req(1, prompt_len=30).prompt_token_ids, 2)


@pytest.mark.parametrize("depth", [1, 2])
def test_preemption_by_recompute_keeps_outputs(depth):
    scheduler, worker = make(num_blocks=12, budget=64)
    requests = [req(i, prompt_len=6, max_tokens=14) for i in range(4)]
    for r in requests:
        scheduler.add_request(r)
    outputs, _ = run(scheduler, worker, depth)
    assert scheduler.num_preemptions > 0
    for r in requests:
        assert outputs[r.request_id] == reference_tokens(r.prompt_token_ids, 14)
    assert_all_free(scheduler)


def test_prefix_cache_hits_skip_shared_prompt_blocks_but_never_the_last_token():
    scheduler, worker = make()
    shared = list(range(1, 17))  # four full blocks
    first = Request("a", [*shared, 50, 51], SamplingParams(temperature=0, max_tokens=3))
    scheduler.add_request(first)
    run(scheduler, worker)
    second = Request("b", [*shared, 60], SamplingParams(temperature=0, max_tokens=3))
    exact = Request("c", list(shared), SamplingParams(temperature=0, max_tokens=3))
    scheduler.add_request(second)
    scheduler.add_request(exact)
    outputs, _ = run(scheduler, worker)
    assert second.num_cached_prompt_tokens == 16
    # The whole prompt is cached, but its last token must be computed: 3 blocks reused.
    assert exact.num_cached_prompt_tokens == 12
    assert outputs["b"] == reference_tokens([*shared, 60], 3)
    assert outputs["c"] == reference_tokens(shared, 3)
    assert scheduler.pool.prefix_hits == 7
    assert_all_free(scheduler)


def test_async_never_over_schedules_max_tokens():
    scheduler, worker = make()
    scheduler.add_request(req(0, max_tokens=5))
    outputs, _ = run(scheduler, worker, depth=2)
    assert len(outputs["r0"]) == 5
    # 1 prefill step + 4 decode steps (then a removal-only plan): never a sixth token computed.
    assert sum(len(p.scheduled_handles) for p in worker.plans) == 5


def test_eos_seen_one_step_late_drops_the_extra_token_and_frees_blocks():
    prompt = [3, 1, 4, 1, 5]
    eos = next_token(prompt + reference_tokens(prompt, 2)[:1])  # the second output token
    scheduler, worker = make(eos=(eos,))
    r = Request("r", prompt, SamplingParams(temperature=0, max_tokens=50))
    scheduler.add_request(r)
    outputs, finish = run(scheduler, worker, depth=2)
    assert outputs["r"] == reference_tokens(prompt, 2)
    assert finish["r"] is FinishReason.STOP
    # The worker computed a third token (the async step) that never reached the output.
    assert sum(1 for p in worker.plans if r.handle in p.scheduled_handles) == 3
    assert_all_free(scheduler)
    assert r.handle in worker.plans[-1].removed_handles and not worker.tokens


def test_min_tokens_and_stop_token_ids():
    prompt = [9, 8, 7]
    expected = reference_tokens(prompt, 10)
    scheduler, worker = make()
    # Stop at the first occurrence of expected[1], but only once two tokens are out.
    scheduler.add_request(Request("s", prompt, SamplingParams(temperature=0, max_tokens=10,
                                                              stop_token_ids=[expected[1]])))
    scheduler.add_request(Request("m", prompt, SamplingParams(temperature=0, max_tokens=10, min_tokens=3,
                                                              stop_token_ids=[expected[1]])))
    outputs, finish = run(scheduler, worker)
    assert outputs["s"] == expected[:2] and finish["s"] is FinishReason.STOP
    assert len(outputs["m"]) >= 3 and finish["m"] in (FinishReason.STOP, FinishReason.LENGTH)


def test_context_length_stops_with_length():
    scheduler, worker = make(max_model_len=20)
    scheduler.add_request(req(0, prompt_len=15, max_tokens=100))
    outputs, finish = run(scheduler, worker, depth=2)
    assert len(outputs["r0"]) == 5 and finish["r0"] is FinishReason.LENGTH
    assert_all_free(scheduler)


def test_placeholder_blocks_are_never_cached():
    scheduler, worker = make()
    r = req(0, prompt_len=4, max_tokens=12)
    scheduler.add_request(r)
    scheduler.update(worker.execute(scheduler.schedule()))  # prefill: one real output token
    plan = scheduler.schedule()  # decode step with a placeholder in flight...
    plan2 = scheduler.schedule()  # ...and the next one, planned before any result
    assert plan and plan2
    # Known tokens: 4 prompt + 1 output; the second block holds placeholders only, uncached.
    assert r.num_registered_blocks == 1
    scheduler.update(worker.execute(plan))
    scheduler.update(worker.execute(plan2))
    scheduler.abort("r0")
    assert_all_free(scheduler)


def test_abort_at_every_lifecycle_point_frees_everything():
    scheduler, worker = make(budget=8)
    scheduler.add_request(req(0, prompt_len=20))  # will be mid-prefill
    scheduler.add_request(req(1, prompt_len=3))
    scheduler.add_request(req(2, prompt_len=3))
    scheduler.update(worker.execute(scheduler.schedule()))
    assert scheduler.requests["r0"].num_computed_tokens == 8  # mid-prefill
    assert scheduler.abort("r0")
    scheduler.update(worker.execute(scheduler.schedule()))
    scheduler.update(worker.execute(scheduler.schedule()))
    assert scheduler.requests["r1"].output_token_ids  # decoding
    assert scheduler.abort("r1")
    assert not scheduler.abort("r1")  # idempotent
    assert not scheduler.abort("nope")
    scheduler.add_request(req(3))  # waiting, never scheduled
    assert scheduler.abort("r3")
    run(scheduler, worker)  # r2 finishes
    assert not scheduler.abort("r2")  # already finished
    assert_all_free(scheduler)
    assert not worker.tokens, "every row was removed from the worker"


def test_priority_policy_orders_waiting_and_picks_victims():
    scheduler, _worker = make(max_num_seqs=1, policy="priority")
    low = Request("low", [1, 2, 3], SamplingParams(temperature=0, max_tokens=2), priority=5)
    high = Request("high", [4, 5, 6], SamplingParams(temperature=0, max_tokens=2), priority=0)
    scheduler.add_request(low)
    scheduler.add_request(high)
    plan = scheduler.schedule()
    assert plan.new_requests[0].handle == high.handle


def test_full_waiting_queue_and_oversized_prompt_are_refused():
    scheduler, _ = make(max_waiting=1, num_blocks=4)
    scheduler.add_request(req(0, prompt_len=3))
    with pytest.raises(QueueFullError):
        scheduler.add_request(req(1, prompt_len=3))
    scheduler2, _ = make(num_blocks=2)
    with pytest.raises(ValueError, match="leaves no room in the context of 8"):
        scheduler2.add_request(req(0, prompt_len=12))


@pytest.mark.parametrize("depth", [1, 2])
def test_a_replaced_worker_recomputes_every_request_to_the_same_tokens(depth):
    """The worker dies twice mid-run (plans in flight, requests mid-prefill, decoding, queued
    and preempted): a fresh worker gets every request again and outputs are unchanged."""
    scheduler, worker = make(num_blocks=14, budget=12)
    requests = [req(i, prompt_len=6 + 5 * i, max_tokens=12) for i in range(5)]
    for r in requests:
        scheduler.add_request(r)
    outputs: dict[str, list[int]] = {}
    in_flight: deque = deque()
    lost_at = {4, 11}
    for step in range(10_000):
        if step in lost_at:
            in_flight.clear()  # their results never come
            affected = scheduler.recompute_all()
            assert {r.request_id for r in affected} == set(scheduler.requests)
            assert scheduler.pool.num_free == scheduler.pool.num_blocks, "every block back, none cached"
            assert all(h is None for h in scheduler.pool.block_hash)
            worker = StubWorker(14, BLOCK)  # steps from 0 again, no rows
        while len(in_flight) < depth and (plan := scheduler.schedule()) is not None:
            in_flight.append(worker.execute(plan))
        if not in_flight:
            break
        for update in scheduler.update(in_flight.popleft()):
            outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
    assert not scheduler.has_unfinished()
    for r in requests:
        assert outputs[r.request_id] == reference_tokens(r.prompt_token_ids, 12)
    assert_all_free(scheduler)


def test_a_request_resumed_with_its_earlier_outputs_continues_them():
    """A request submitted again with the tokens it had already produced (a scheduler's
    failover) computes only the rest, and its budget counts the earlier ones."""
    scheduler, worker = make()
    prompt = req(3, prompt_len=9).prompt_token_ids
    expected = reference_tokens(prompt, 10)
    resumed = Request("r3", list(prompt), SamplingParams(temperature=0, max_tokens=10),
                      output_token_ids=expected[:4])
    scheduler.add_request(resumed)
    outputs, finish = run(scheduler, worker)
    assert outputs["r3"] == expected[4:]
    assert finish["r3"] is FinishReason.LENGTH
    assert_all_free(scheduler)
