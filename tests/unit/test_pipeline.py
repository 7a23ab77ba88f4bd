"""The one pipeline rule both transports use: depth validated, plans counted in flight as they
go out, results applied in order."""

from __future__ import annotations

import pytest

from tests.support.factories import make_scheduler
from vmesh.services.common.step_types import StepResult
from vmesh.services.common.types import SamplingParams
from vmesh.services.scheduler.pipeline import StepPipeline
from vmesh.services.scheduler.request import Request
from vmesh.services.scheduler.scheduler import Scheduler


def scheduler() -> Scheduler:
    s = make_scheduler(num_blocks=32, block_size=4, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64,
                       eos_token_ids=(0,))
    s.add_request(Request("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)))
    return s


@pytest.mark.parametrize("depth", [0, 3, -1])
def test_only_depths_one_and_two_are_accepted(depth):
    with pytest.raises(ValueError, match="pipeline depth"):
        StepPipeline(scheduler(), depth)


@pytest.mark.parametrize("depth", [1, 2])
def test_at_most_depth_plans_are_in_flight(depth):
    pipeline = StepPipeline(scheduler(), depth)
    sent = list(pipeline.plans())
    assert len(sent) == depth == pipeline.in_flight  # step N+1 is planned before step N returns
    assert list(pipeline.plans()) == []  # full
    updates = pipeline.complete(StepResult(sent[0].step, [sent[0].scheduled_handles[0]], [9]))
    assert pipeline.in_flight == depth - 1 and updates
    assert len(list(pipeline.plans())) == 1


def test_a_result_without_a_plan_is_refused():
    pipeline = StepPipeline(scheduler(), 2)
    with pytest.raises(RuntimeError, match="no plan in flight"):
        pipeline.complete(StepResult(0, [], []))


def test_results_out_of_order_are_refused_and_a_failed_step_can_be_abandoned():
    pipeline = StepPipeline(scheduler(), 2)
    _first, second = list(pipeline.plans())
    with pytest.raises(RuntimeError, match="oldest in flight"):
        pipeline.complete(StepResult(second.step, [], []))
    pipeline.abandon_oldest()  # the first step's execution failed
    assert pipeline.in_flight == 1
    pipeline.complete(StepResult(second.step, [], []))
    assert pipeline.idle
