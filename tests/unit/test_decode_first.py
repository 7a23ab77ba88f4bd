"""Decode first: while requests decode, a step carries at most max_prefill_tokens_with_decodes
prefill tokens (running prompts' chunks and admissions together), so a long prompt or a burst of
them delays every running stream by a bounded amount per step; the prompts still advance by the
cap each step (no starvation), steps without decodes take the whole budget, and the tokens each
request gets are the same as without the cap."""

from __future__ import annotations

from collections import deque

import pytest

from tests.support.factories import make_scheduler
from tests.support.stub_worker import StubWorker, reference_tokens
from vmesh.services.common.types import SamplingParams
from vmesh.services.scheduler.request import Request
from vmesh.services.scheduler.scheduler import Scheduler
from vmesh.services.scheduler.settings import SchedulerConfig

BLOCK = 4
BUDGET = 64
CAP = 12


def make(cap: int, max_num_seqs: int = 16) -> tuple[Scheduler, StubWorker]:
    scheduler = make_scheduler(num_blocks=512, block_size=BLOCK, max_model_len=512, max_num_seqs=max_num_seqs,
                               max_num_batched_tokens=BUDGET, hash_seed=1, max_prefill_tokens_with_decodes=cap)
    return scheduler, StubWorker(512, BLOCK)


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 31 + 7 * i) % 89 + 1 for i in range(length)]


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def decoding(scheduler: Scheduler) -> set[int]:
    """The handles that decode in the next step: running, one (placeholder) token left to compute."""
    return {r.handle for r in scheduler.running if r.handle is not None
            and r.num_tokens_with_placeholders - r.num_computed_tokens == 1
            and len(r.output_token_ids) + r.num_placeholders < r.sampling.max_tokens}


def drive(scheduler: Scheduler, worker: StubWorker, arrivals: dict[int, list[Request]], depth: int = 2):
    """Steps at pipeline depth `depth`, adding `arrivals[step]` before planning that step. Returns
    the outputs per request and, per plan, (handles decoding before it, {handle: tokens})."""
    outputs: dict[str, list[int]] = {}
    steps: list[tuple[set[int], dict[int, int]]] = []
    in_flight: deque = deque()
    for step in range(10_000):
        for request in arrivals.get(step, []):
            scheduler.add_request(request)
        while len(in_flight) < depth:
            before = decoding(scheduler)
            if (plan := scheduler.schedule()) is None:
                break
            steps.append((before, dict(zip(plan.scheduled_handles, plan.num_scheduled_tokens))))
            in_flight.append(worker.execute(plan))
        if not in_flight and step > max(arrivals):
            break
        if in_flight:
            for update in scheduler.update(in_flight.popleft()):
                outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
    return outputs, steps


def burst(streams: int = 4, prompts: int = 6) -> dict[int, list[Request]]:
    """`streams` short prompts that decode for long, then a burst of long prompts two steps later."""
    early = [Request(f"s{i}", prompt(i, 5), params(120)) for i in range(streams)]
    late = [Request(f"p{i}", prompt(100 + i, 150 + 13 * i), params(8)) for i in range(prompts)]
    return {0: early, 2: late}


def test_a_step_with_decodes_carries_at_most_the_cap_in_prefill_tokens():
    scheduler, worker = make(CAP)
    _, steps = drive(scheduler, worker, burst())
    capped = 0
    for decodes, scheduled in steps:
        if not decodes:
            continue
        prefill = sum(n for handle, n in scheduled.items() if handle not in decodes)
        assert prefill <= CAP
        assert all(scheduled.get(handle) == 1 for handle in decodes)  # every decode got its token
        capped += prefill == CAP
    assert capped > 50  # the burst's ~1,000 prompt tokens went through in capped steps


def test_without_the_cap_prefill_fills_the_budget_beside_decodes():
    scheduler, worker = make(0)
    _, steps = drive(scheduler, worker, burst())
    prefill = [sum(n for h, n in scheduled.items() if h not in decodes) for decodes, scheduled in steps if decodes]
    assert max(prefill) == BUDGET - 4  # the 4 decodes' tokens and the rest of the budget in prefill


def test_a_step_without_decodes_takes_the_whole_budget():
    scheduler, worker = make(CAP)
    _, steps = drive(scheduler, worker, {0: [Request(f"p{i}", prompt(i, 40), params(4)) for i in range(3)]})
    decodes, first = steps[0]
    assert not decodes and sum(first.values()) == BUDGET


def test_every_prompt_advances_by_the_cap_each_step_while_streams_decode():
    # One 300-token prompt behind 4 streams that decode throughout: its prefill takes exactly
    # ceil(300 / CAP) steps, each carrying CAP of its tokens beside the 4 decodes.
    scheduler, worker = make(CAP)
    arrivals = burst(prompts=0)
    arrivals[3] = [Request("long", prompt(7, 300), params(3))]
    outputs, steps = drive(scheduler, worker, arrivals)
    handle = max(h for _, scheduled in steps for h in scheduled)  # the last admitted
    chunks = [scheduled[handle] for _, scheduled in steps if handle in scheduled]
    assert chunks[:-(3 - 1)] == [CAP] * (300 // CAP)
    assert outputs["long"] == reference_tokens(prompt(7, 300), 3)


@pytest.mark.parametrize("depth", [1, 2])
def test_the_cap_changes_no_request_s_tokens(depth):
    results = []
    for cap in (0, CAP, 1):
        scheduler, worker = make(cap)
        outputs, _ = drive(scheduler, worker, burst(), depth=depth)
        results.append(outputs)
        assert not scheduler.has_unfinished() and scheduler.pool.stats().num_free == 512
    assert results[0] == results[1] == results[2]
    for request in burst()[2]:
        assert results[1][request.request_id] == reference_tokens(request.prompt_token_ids, 8)


def test_a_negative_cap_is_refused():
    with pytest.raises(ValueError, match="max_prefill_tokens_with_decodes must be 0"):
        SchedulerConfig(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64, policy="fcfs",
                        max_waiting=None, max_prefill_tokens_with_decodes=-1)


def test_the_offline_engine_is_uncapped_and_the_mesh_s_scheduler_capped():
    # Offline (EngineConfig) a burst of prompts enters in one step beside the running decodes; the
    # mesh's scheduler service keeps the serving bound, and so does an engine given its defaults.
    from vmesh.services.engine.llm import EngineConfig, serving_scheduler_defaults
    from vmesh.services.scheduler.scheduler import WorkerGeometry
    from vmesh.services.scheduler.settings import (
        DEFAULT_MAX_PREFILL_TOKENS_WITH_DECODES,
        SchedulerServiceSettings,
    )

    geometry = WorkerGeometry(max_model_len=512, max_num_seqs=16, num_kv_blocks=512, block_size=BLOCK)
    widest = {}
    for name, settings in (("engine", EngineConfig()), ("mesh", SchedulerServiceSettings()),
                           ("engine as served", EngineConfig(**serving_scheduler_defaults()))):
        scheduler = Scheduler.for_worker(settings, geometry, hash_seed=1)
        _, steps = drive(scheduler, StubWorker(512, BLOCK), burst())
        widest[name] = max(sum(n for h, n in scheduled.items() if h not in decodes)
                           for decodes, scheduled in steps if decodes)
    late_prompt_tokens = sum(len(r.prompt_token_ids) for r in burst()[2])
    assert widest == {"engine": late_prompt_tokens, "mesh": DEFAULT_MAX_PREFILL_TOKENS_WITH_DECODES,
                      "engine as served": DEFAULT_MAX_PREFILL_TOKENS_WITH_DECODES}
