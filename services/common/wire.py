"""Translation between the core types and their protobuf messages: one place, used by every
gRPC shell."""

from __future__ import annotations

from vmesh.services.common.logprobs import pack_logprobs, unpack_logprobs
from vmesh.services.common.sampling_params import OutputMode, SamplingParams
from vmesh.services.common.step_types import NewRequest, StepPlan, StepResult
from vmesh.v1 import common_pb2, worker_pb2

_OUTPUT_MODES = {
    common_pb2.OUTPUT_MODE_UNSPECIFIED: OutputMode.DELTA,
    common_pb2.OUTPUT_MODE_DELTA: OutputMode.DELTA,
    common_pb2.OUTPUT_MODE_CUMULATIVE: OutputMode.CUMULATIVE,
    common_pb2.OUTPUT_MODE_FINAL_ONLY: OutputMode.FINAL_ONLY,
}
_OUTPUT_MODES_PB = {
    OutputMode.DELTA: common_pb2.OUTPUT_MODE_DELTA,
    OutputMode.CUMULATIVE: common_pb2.OUTPUT_MODE_CUMULATIVE,
    OutputMode.FINAL_ONLY: common_pb2.OUTPUT_MODE_FINAL_ONLY,
}


# max_tokens when a request leaves it unset (common.proto); the frontend fills in the context's room instead.
DEFAULT_MAX_TOKENS = 16


def sampling_from_proto(pb: common_pb2.SamplingParams, default_max_tokens: int = DEFAULT_MAX_TOKENS) -> SamplingParams:
    """The one translation of the proto into SamplingParams. Doors (frontend, scheduler) reach it
    through admission.admit, which checks the result."""
    return SamplingParams(
        temperature=pb.temperature if pb.HasField("temperature") else 1.0,
        top_p=pb.top_p if pb.HasField("top_p") else 1.0,
        top_k=pb.top_k if pb.HasField("top_k") else -1,
        min_p=pb.min_p,
        repetition_penalty=pb.repetition_penalty if pb.HasField("repetition_penalty") else 1.0,
        presence_penalty=pb.presence_penalty,
        frequency_penalty=pb.frequency_penalty,
        seed=pb.seed if pb.HasField("seed") else None,
        max_tokens=pb.max_tokens if pb.HasField("max_tokens") else default_max_tokens,
        min_tokens=pb.min_tokens,
        ignore_eos=pb.ignore_eos,
        stop_token_ids=list(pb.stop_token_ids),
        stop=list(pb.stop),
        include_stop_str_in_output=pb.include_stop_str_in_output,
        skip_special_tokens=pb.skip_special_tokens if pb.HasField("skip_special_tokens") else True,
        logprobs=pb.logprobs if pb.HasField("logprobs") else None,
        output_mode=_OUTPUT_MODES.get(pb.output_mode, OutputMode.DELTA),
    )


def sampling_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    pb = common_pb2.SamplingParams(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
        repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty, max_tokens=p.max_tokens, min_tokens=p.min_tokens,
        ignore_eos=p.ignore_eos, stop_token_ids=p.stop_token_ids, stop=p.stop,
        include_stop_str_in_output=p.include_stop_str_in_output, skip_special_tokens=p.skip_special_tokens,
        output_mode=_OUTPUT_MODES_PB[p.output_mode])
    if p.seed is not None:
        pb.seed = p.seed
    if p.logprobs is not None:
        pb.logprobs = p.logprobs
    return pb


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
    pb = worker_pb2.ExecuteResponse(
        step=r.step, handles=r.handles, sampled_token_ids=r.sampled_token_ids, logprobs_handles=r.logprobs_handles,
        forward_seconds=r.forward_seconds, sampling_seconds=r.sampling_seconds)
    pack_logprobs(r.logprobs, pb.logprobs)
    return pb


def result_from_proto(pb: worker_pb2.ExecuteResponse) -> StepResult:
    return StepResult(
        step=pb.step, handles=list(pb.handles), sampled_token_ids=list(pb.sampled_token_ids),
        logprobs_handles=list(pb.logprobs_handles), logprobs=unpack_logprobs(pb.logprobs),
        forward_seconds=pb.forward_seconds, sampling_seconds=pb.sampling_seconds)
