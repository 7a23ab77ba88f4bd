"""The scheduler -> worker link: StepPlan <-> ExecuteRequest and StepResult <-> ExecuteResponse."""

from __future__ import annotations

from vmesh.services.common.step_types import NewRequest, StepPlan, StepResult
from vmesh.services.common.wire.common import pack_logprobs, unpack_logprobs
from vmesh.services.common.wire.sampling import sampling_from_proto, sampling_to_proto
from vmesh.v1 import worker_pb2


def plan_to_proto(plan: StepPlan, full_state: bool = False) -> worker_pb2.ExecuteRequest:
    return worker_pb2.ExecuteRequest(
        step=plan.step,
        new_requests=[worker_pb2.NewRequest(
            handle=r.handle, token_ids=r.token_ids, num_prompt_tokens=r.num_prompt_tokens,
            sampling=sampling_to_proto(r.sampling), block_ids=r.block_ids,
            num_computed_tokens=r.num_computed_tokens) for r in plan.new_requests],
        removed_handles=plan.removed_handles, scheduled_handles=plan.scheduled_handles,
        num_scheduled_tokens=plan.num_scheduled_tokens, new_block_ids=plan.new_block_ids,
        num_new_blocks=plan.num_new_blocks, full_state=full_state)


def plan_from_proto(pb: worker_pb2.ExecuteRequest) -> StepPlan:
    return StepPlan(
        step=pb.step,
        new_requests=[NewRequest(r.handle, list(r.token_ids), r.num_prompt_tokens, sampling_from_proto(r.sampling),
                                 list(r.block_ids), r.num_computed_tokens) for r in pb.new_requests],
        removed_handles=list(pb.removed_handles), scheduled_handles=list(pb.scheduled_handles),
        num_scheduled_tokens=list(pb.num_scheduled_tokens), new_block_ids=list(pb.new_block_ids),
        num_new_blocks=list(pb.num_new_blocks))


def result_to_proto(r: StepResult) -> worker_pb2.ExecuteResponse:
    # StepResult keeps the wire's encoding of row ownership (a handle beside each row): rows go as they are.
    pb = worker_pb2.ExecuteResponse(
        step=r.step, handles=r.handles, sampled_token_ids=r.sampled_token_ids, logprobs_handles=r.logprobs_handles,
        forward_seconds=r.forward_seconds, sampling_seconds=r.sampling_seconds, failed_handles=r.failed_handles,
        failure_messages=r.failure_messages)
    pack_logprobs(r.logprobs, pb.logprobs)
    return pb


def result_from_proto(pb: worker_pb2.ExecuteResponse) -> StepResult:
    return StepResult(
        step=pb.step, handles=list(pb.handles), sampled_token_ids=list(pb.sampled_token_ids),
        logprobs_handles=list(pb.logprobs_handles), logprobs=unpack_logprobs(pb.logprobs),
        forward_seconds=pb.forward_seconds, sampling_seconds=pb.sampling_seconds,
        failed_handles=list(pb.failed_handles), failure_messages=list(pb.failure_messages))
