"""The scheduler -> worker link: StepPlan <-> ExecuteRequest and StepResult <-> ExecuteResponse."""

from __future__ import annotations

from vmesh.services.common.step_timeline import Distribution, TimelineSummary, WorkerStepTiming
from vmesh.services.common.step_types import NewRequest, StepPlan, StepResult
from vmesh.services.common.wire.common import (
    pack_logprobs,
    pack_owned,
    pack_vectors,
    unpack_logprobs,
    unpack_owned,
    unpack_vectors,
)
from vmesh.services.common.wire.sampling import sampling_from_proto, sampling_to_proto
from vmesh.v1 import worker_pb2


def plan_to_proto(plan: StepPlan, full_state: bool = False) -> worker_pb2.ExecuteRequest:
    return worker_pb2.ExecuteRequest(
        step=plan.step,
        new_requests=[worker_pb2.NewRequest(
            handle=r.handle, token_ids=r.token_ids, num_prompt_tokens=r.num_prompt_tokens,
            sampling=sampling_to_proto(r.sampling), block_ids=r.block_ids,
            num_computed_tokens=r.num_computed_tokens, lora_name=r.lora_name) for r in plan.new_requests],
        removed_handles=plan.removed_handles, scheduled_handles=plan.scheduled_handles,
        num_scheduled_tokens=plan.num_scheduled_tokens, new_block_ids=plan.new_block_ids,
        num_new_blocks=plan.num_new_blocks, num_draft_slots=plan.num_draft_slots, full_state=full_state)


def plan_from_proto(pb: worker_pb2.ExecuteRequest) -> StepPlan:
    return StepPlan(
        step=pb.step,
        new_requests=[NewRequest(r.handle, list(r.token_ids), r.num_prompt_tokens, sampling_from_proto(r.sampling),
                                 list(r.block_ids), r.num_computed_tokens, lora_name=r.lora_name)
                      for r in pb.new_requests],
        removed_handles=list(pb.removed_handles), scheduled_handles=list(pb.scheduled_handles),
        num_scheduled_tokens=list(pb.num_scheduled_tokens), new_block_ids=list(pb.new_block_ids),
        num_new_blocks=list(pb.num_new_blocks), num_draft_slots=list(pb.num_draft_slots))


def result_to_proto(r: StepResult) -> worker_pb2.ExecuteResponse:
    # StepResult keeps the wire's encoding of row ownership (a handle beside each row): rows go as they are.
    pb = worker_pb2.ExecuteResponse(
        step=r.step, handles=r.handles, sampled_token_ids=r.sampled_token_ids, num_sampled_tokens=r.num_sampled_tokens,
        num_draft_tokens=r.num_draft_tokens, logprobs_handles=r.logprobs_handles,
        forward_seconds=r.forward_seconds, sampling_seconds=r.sampling_seconds, failed_handles=r.failed_handles,
        failure_messages=r.failure_messages)
    pack_logprobs(r.logprobs, pb.logprobs)
    pb.prompt_logprobs_handles.extend(pack_owned(r.prompt_logprobs.items(), pb.prompt_logprobs))
    pb.embedding_handles.extend(pack_vectors(r.embeddings.items(), pb.embeddings))
    if r.timing is not None:
        pb.timing.CopyFrom(timing_to_proto(r.timing))
    return pb


def result_from_proto(pb: worker_pb2.ExecuteResponse) -> StepResult:
    return StepResult(
        step=pb.step, handles=list(pb.handles), sampled_token_ids=list(pb.sampled_token_ids),
        num_sampled_tokens=list(pb.num_sampled_tokens), num_draft_tokens=list(pb.num_draft_tokens),
        logprobs_handles=list(pb.logprobs_handles), logprobs=unpack_logprobs(pb.logprobs),
        prompt_logprobs=unpack_owned(pb.prompt_logprobs_handles, pb.prompt_logprobs),
        embeddings=unpack_vectors(pb.embedding_handles, pb.embeddings),
        forward_seconds=pb.forward_seconds, sampling_seconds=pb.sampling_seconds,
        failed_handles=list(pb.failed_handles), failure_messages=list(pb.failure_messages),
        timing=timing_from_proto(pb.timing, pb.step, pb.forward_seconds, pb.sampling_seconds)
        if pb.HasField("timing") else None)


def timing_to_proto(t: WorkerStepTiming) -> worker_pb2.StepTiming:
    """The step's step number, forward and sampling seconds travel in the result itself."""
    previous = t.idle_before_seconds is not None
    return worker_pb2.StepTiming(
        plan_wait_seconds=t.plan_wait_seconds, plan_decode_seconds=t.plan_decode_seconds,
        execute_seconds=t.execute_seconds, received_to_done_seconds=t.received_to_done_seconds,
        has_previous=previous, idle_before_seconds=t.idle_before_seconds or 0.0,
        waited_for_plan_seconds=t.waited_for_plan_seconds or 0.0, rows=t.rows, tokens=t.tokens)


def timing_from_proto(pb: worker_pb2.StepTiming, step: int, forward_seconds: float,
                      sampling_seconds: float) -> WorkerStepTiming:
    return WorkerStepTiming(
        step=step, rows=pb.rows, tokens=pb.tokens, plan_wait_seconds=pb.plan_wait_seconds,
        plan_decode_seconds=pb.plan_decode_seconds, execute_seconds=pb.execute_seconds,
        forward_seconds=forward_seconds, sampling_seconds=sampling_seconds,
        idle_before_seconds=pb.idle_before_seconds if pb.has_previous else None,
        waited_for_plan_seconds=pb.waited_for_plan_seconds if pb.has_previous else None,
        received_to_done_seconds=pb.received_to_done_seconds)


_DISTRIBUTIONS = ("idle_gap", "waited_for_plan", "plan_wait", "plan_decode", "result_encode", "rows")


def summary_to_proto(s: TimelineSummary) -> worker_pb2.StepTimelineSummary:
    pb = worker_pb2.StepTimelineSummary(steps=s.steps, busy_seconds=s.busy_seconds, span_seconds=s.span_seconds)
    for name in _DISTRIBUTIONS:
        d: Distribution = getattr(s, name)
        getattr(pb, name).CopyFrom(worker_pb2.Distribution(p50=d.p50, p90=d.p90, p99=d.p99, max=d.max,
                                                           mean=d.mean, count=d.count))
    return pb


def summary_from_proto(pb: worker_pb2.StepTimelineSummary) -> TimelineSummary:
    s = TimelineSummary(steps=pb.steps, busy_seconds=pb.busy_seconds, span_seconds=pb.span_seconds)
    for name in _DISTRIBUTIONS:
        d = getattr(pb, name)
        setattr(s, name, Distribution(d.p50, d.p90, d.p99, d.max, d.mean, d.count))
    return s
