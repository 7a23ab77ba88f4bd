"""The frontend -> scheduler link: Submission -> SubmitRequestRequest, the abort of a request and the
take-over of one its client resumes."""

from __future__ import annotations

from vmesh.services.common.generation import Submission
from vmesh.services.common.resume import ResumePoint
from vmesh.services.common.wire.common import trace_context_to_proto
from vmesh.services.common.wire.sampling import sampling_to_proto
from vmesh.v1 import scheduler_pb2


def submission_to_proto(s: Submission) -> scheduler_pb2.SubmitRequestRequest:
    return scheduler_pb2.SubmitRequestRequest(
        frontend_id=s.frontend_id, frontend_key=s.frontend_key, prompt_token_ids=s.prompt_token_ids,
        sampling=sampling_to_proto(s.sampling), priority=s.priority,
        trace_context=trace_context_to_proto(s.trace_context), detokenizers=s.detokenizers,
        resumed_output_token_ids=s.resumed_output_token_ids, resumed_text_length=s.resumed_text_length,
        lora_name=s.lora_name, resume_key=s.resume_key, prompt_digest=s.prompt_digest)


def take_over_to_proto(resume: ResumePoint, prompt_digest: bytes) -> scheduler_pb2.TakeOverRequestRequest:
    return scheduler_pb2.TakeOverRequestRequest(resume_key=resume.key, prompt_digest=prompt_digest,
                                                num_output_tokens=resume.num_output_tokens)


def abort_to_proto(frontend_id: str, frontend_key: int) -> scheduler_pb2.AbortRequestRequest:
    return scheduler_pb2.AbortRequestRequest(frontend_id=frontend_id, frontend_key=frontend_key)
