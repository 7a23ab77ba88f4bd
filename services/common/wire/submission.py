"""The frontend -> scheduler link: Submission -> SubmitRequestRequest, and the abort of a request."""

from __future__ import annotations

from vmesh.services.common.generation import Submission
from vmesh.services.common.wire.common import trace_context_to_proto
from vmesh.services.common.wire.sampling import sampling_to_proto
from vmesh.v1 import scheduler_pb2


def submission_to_proto(s: Submission) -> scheduler_pb2.SubmitRequestRequest:
    return scheduler_pb2.SubmitRequestRequest(
        frontend_id=s.frontend_id, frontend_key=s.frontend_key, prompt_token_ids=s.prompt_token_ids,
        sampling=sampling_to_proto(s.sampling), priority=s.priority,
        trace_context=trace_context_to_proto(s.trace_context), detokenizers=s.detokenizers,
        resumed_output_token_ids=s.resumed_output_token_ids, resumed_text_length=s.resumed_text_length,
        lora_name=s.lora_name)


def abort_to_proto(frontend_id: str, frontend_key: int) -> scheduler_pb2.AbortRequestRequest:
    return scheduler_pb2.AbortRequestRequest(frontend_id=frontend_id, frontend_key=frontend_key)
