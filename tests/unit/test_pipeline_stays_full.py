"""Async scheduling's promise, checked on the real scheduler and the real persistent batch: at
depth 2 the worker has its next plan before it finishes the current step, whatever happens to
the batch (arrivals, EOS and length finishes, aborts, preemption), and each step costs one plan
whatever the batch holds.

The worker is simulated: the persistent batch applies each plan exactly as the worker does, and
a seeded stream of token ids stands in for the model, with EOS drawn now and then."""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

import pytest
import torch

from tests.support.factories import make_scheduler
from vmesh.services.common.step_types import StepPlan, StepResult
from vmesh.services.common.types import SamplingParams
from vmesh.services.scheduler.pipeline import StepPipeline
from vmesh.services.scheduler.request import Request
from vmesh.services.scheduler.scheduler import Scheduler
from vmesh.services.worker.persistent_batch import PersistentBatch

EOS = 0
BLOCK_SIZE = 4
MAX_MODEL_LEN = 128


@dataclass
class SimulatedWorker:
    """Executes plans in order on a real PersistentBatch; tokens come from a seeded generator."""
    batch: PersistentBatch
    rng: random.Random
    eos_rate: float
    executed: int = 0

    def execute(self, plan: StepPlan) -> StepResult:
        self.batch.apply(plan)
        self.executed += 1
        if not plan.scheduled_handles:
            return StepResult(plan.step, [], [])
        inputs = self.batch.prepare_inputs(plan)
        sampled = torch.tensor([EOS if self.rng.random() < self.eos_rate else self.rng.randrange(1, 500)
                                for _ in plan.scheduled_handles])
        produced = self.batch.finish_step(inputs, sampled)
        handles = torch.tensor(plan.scheduled_handles)[produced].tolist()
        return StepResult(plan.step, handles, sampled[produced].tolist())


@dataclass
class Trace:
    steps: int = 0
    waits: list[str] = field(default_factory=list)  # why the worker finished a step with none queued
    plans_per_step: list[int] = field(default_factory=list)
    preemptions: int = 0


def schedulable(scheduler: Scheduler) -> list[str]:
    """The requests the scheduler could plan a step for now, with the seats and blocks it has:
    running ones short of their budget, and waiting ones whose next chunk fits. (A waiting request
    that needs blocks only an in-flight step's finish will free is not ready: nothing knows yet.)"""
    ready = []
    for r in scheduler.running:
        produced = len(r.output_token_ids) + r.num_placeholders
        if produced < r.sampling.max_tokens and r.num_tokens_with_placeholders < MAX_MODEL_LEN:
            ready.append(f"running {r.request_id}")
    seats = scheduler.config.max_num_seqs - len(scheduler.running)
    free = scheduler.pool.stats().num_free
    # Decode first: beside a running decode the next chunk is the prefill cap's at most.
    budget = scheduler.config.max_num_batched_tokens
    if scheduler.config.max_prefill_tokens_with_decodes and any(
            r.num_tokens_with_placeholders - r.num_computed_tokens == 1 for r in scheduler.running):
        budget = min(budget, scheduler.config.max_prefill_tokens_with_decodes)
    for r in scheduler.waiting[:seats]:
        chunk = min(r.num_tokens, budget)
        if -(-chunk // BLOCK_SIZE) <= free:
            note = " (preempted, its token in flight)" if r.num_placeholders else ""
            ready.append(f"waiting {r.request_id}{note}")
        break  # first come, first served: the head of the queue decides
    return ready


def run(seed: int, *, num_blocks: int, max_num_seqs: int, num_requests: int, eos_rate: float,
        abort_rate: float, depth: int = 2, prefill_cap: int = 0) -> Trace:
    rng = random.Random(seed)
    scheduler = make_scheduler(num_blocks=num_blocks, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
                               max_num_seqs=max_num_seqs, max_num_batched_tokens=48, eos_token_ids=(EOS,),
                               max_prefill_tokens_with_decodes=prefill_cap)
    pipeline = StepPipeline(scheduler, depth)
    worker = SimulatedWorker(PersistentBatch(max_num_seqs, MAX_MODEL_LEN, BLOCK_SIZE, torch.device("cpu"),
                                             num_blocks), rng, eos_rate)
    queue: deque[StepPlan] = deque()  # plans sent, not yet executed
    trace = Trace()
    arrived = 0

    def arrive() -> None:
        nonlocal arrived
        for _ in range(rng.choice([0, 0, 0, 1, 1, 2])):
            if arrived < num_requests:
                prompt = [rng.randrange(1, 500) for _ in range(rng.randrange(1, 40))]
                params = SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 30),
                                        ignore_eos=rng.random() < 0.3)
                scheduler.add_request(Request(f"r{arrived}", prompt, params))
                arrived += 1

    arrive()
    while arrived < num_requests or pipeline.has_work():
        sent = list(pipeline.plans())
        queue.extend(sent)
        trace.plans_per_step.append(len(sent))
        if not queue:  # nothing to compute: idle until the next arrival (not a wait for a plan)
            arrive()
            continue
        plan = queue.popleft()
        result = worker.execute(plan)
        trace.steps += 1
        # The worker now starts the next step at once if its plan is already queued. The
        # scheduler has not seen this step's result yet, so what it could still plan is judged
        # from its state before the result, as a real worker finishing now would find it.
        if not queue and (why := schedulable(scheduler)):
            trace.waits.append(f"step {plan.step}: worker idle with {why}")
        pipeline.complete(result)
        if scheduler.running and rng.random() < abort_rate:
            scheduler.abort(rng.choice(scheduler.running).request_id)
        arrive()
    assert not scheduler.has_unfinished() and scheduler.pool.stats().num_free == num_blocks  # no block leaked
    trace.preemptions = scheduler.stats().num_preemptions
    return trace


@pytest.mark.parametrize("seed", range(6))
def test_the_worker_never_waits_for_a_plan_under_arrivals_and_finishes(seed):
    trace = run(seed, num_blocks=256, max_num_seqs=8, num_requests=60, eos_rate=0.05, abort_rate=0.02)
    assert trace.steps > 50
    assert trace.waits == []


@pytest.mark.parametrize("seed", range(3))
def test_the_worker_never_waits_for_a_plan_with_prompts_in_capped_chunks(seed):
    # Decode first: beside running decodes every prompt enters in chunks of at most 8 tokens.
    trace = run(seed, num_blocks=256, max_num_seqs=8, num_requests=60, eos_rate=0.05, abort_rate=0.02,
                prefill_cap=8)
    assert trace.steps > 50
    assert trace.waits == []


@pytest.mark.parametrize("seed", range(6))
def test_the_worker_never_waits_for_a_plan_under_preemption(seed):
    # 24 blocks of 4 tokens cannot hold 8 requests of up to 70 tokens: the scheduler preempts.
    trace = run(seed, num_blocks=24, max_num_seqs=8, num_requests=40, eos_rate=0.02, abort_rate=0.0)
    assert trace.steps > 50 and trace.preemptions > 0
    assert trace.waits == []


def test_the_check_sees_a_synchronous_worker_wait():
    # Depth 1 is the synchronous loop: the worker waits for the scheduler after every step.
    trace = run(0, num_blocks=256, max_num_seqs=8, num_requests=60, eos_rate=0.05, abort_rate=0.02, depth=1)
    assert len(trace.waits) > trace.steps // 2


def test_each_step_is_one_plan_whatever_the_batch_holds():
    # At most the pipeline's depth goes out at once, and every plan sent is a step executed.
    trace = run(0, num_blocks=256, max_num_seqs=8, num_requests=60, eos_rate=0.05, abort_rate=0.02)
    assert max(trace.plans_per_step) <= 2 and sum(trace.plans_per_step) == trace.steps
