"""The public API (frontend.proto): GenerateRequest and TokenizeRequest decoded into the core
types the frontend serves (services/common/generation.py), its outputs encoded as
GenerateResponses, and the ranges the API's fields can carry."""

from __future__ import annotations

import ctypes
from collections.abc import Iterable
from functools import cache
from typing import Any

from google.protobuf.descriptor import FieldDescriptor

from vmesh.services.common.generation import Chat, ChatMessage, GenerationOutput, GenerationRequest, Prompt, ToolCall
from vmesh.services.common.resume import ResumePoint
from vmesh.services.common.types import TokenLogprobs, Usage
from vmesh.services.common.wire.common import finish_to_proto
from vmesh.services.common.wire.sampling import sampling_from_proto
from vmesh.v1 import frontend_pb2

_INT_RANGES = {
    FieldDescriptor.CPPTYPE_INT32: (-(1 << 31), (1 << 31) - 1),
    FieldDescriptor.CPPTYPE_UINT32: (0, (1 << 32) - 1),
    FieldDescriptor.CPPTYPE_INT64: (-(1 << 63), (1 << 63) - 1),
    FieldDescriptor.CPPTYPE_UINT64: (0, (1 << 64) - 1),
}


def chat_from_public(pb: frontend_pb2.ChatMessages) -> Chat:
    return Chat([ChatMessage(m.role, m.content, [ToolCall(c.id, c.name, c.arguments) for c in m.tool_calls],
                             m.tool_call_id) for m in pb.messages], pb.tools)


def prompt_from_public(pb: frontend_pb2.GenerateRequest | frontend_pb2.TokenizeRequest) -> Prompt | None:
    """The request's input; token ids stay the message's own (uncopied) sequence, so that the
    frontend may measure them before it copies them."""
    which = pb.WhichOneof("input")
    if which == "text":
        return pb.text
    if which == "chat":
        return chat_from_public(pb.chat)
    if which == "token_ids":
        assert isinstance(pb, frontend_pb2.GenerateRequest)
        return pb.token_ids.ids
    return None


def request_from_public(pb: frontend_pb2.GenerateRequest) -> GenerationRequest:
    """Unset sampling fields take the core defaults; max_tokens unset, the context's room."""
    resume = (ResumePoint(pb.resume.token, pb.resume.num_output_tokens, pb.resume.text_length)
              if pb.HasField("resume") else None)
    return GenerationRequest(prompt_from_public(pb), sampling_from_proto(pb.sampling),
                             max_tokens_from_context=not pb.sampling.HasField("max_tokens"), model=pb.model,
                             priority=pb.priority, resume_key=resume.key if resume else "", resume_from=resume)


def logprobs_to_public(rows: Iterable[TokenLogprobs]) -> list[frontend_pb2.GeneratedTokenLogprobs]:
    """The public API's per-token form, which clients read row by row."""
    return [frontend_pb2.GeneratedTokenLogprobs(
        logprob=row.logprob, rank=row.rank,
        top=[frontend_pb2.TokenLogprob(token_id=t, logprob=lp) for t, lp in zip(row.top_token_ids, row.top_logprobs)])
        for row in rows]


def usage_to_public(usage: Usage | None) -> frontend_pb2.Usage | None:
    if usage is None:
        return None
    return frontend_pb2.Usage(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                              cached_prompt_tokens=usage.cached_prompt_tokens)


def output_to_public(out: GenerationOutput) -> frontend_pb2.GenerateResponse:
    return frontend_pb2.GenerateResponse(
        request_id=out.request_id, text=out.text, token_ids=out.token_ids, logprobs=logprobs_to_public(out.logprobs),
        finish_reason=finish_to_proto(out.finish_reason), usage=usage_to_public(out.usage),
        structured_output_backend=out.structured_backend, prompt_token_ids=out.prompt_token_ids,
        prompt_logprobs=logprobs_to_public(out.prompt_logprobs), embedding=out.embedding,
        resume_token=out.resume_key)


@cache
def _cpp_type(path: str) -> int:
    """The C++ type (FieldDescriptor.CPPTYPE_*) of GenerateRequest's field `path`."""
    descriptor = frontend_pb2.GenerateRequest.DESCRIPTOR
    *heads, name = path.split(".")
    for head in heads:
        message = descriptor.fields_by_name[head].message_type
        assert message is not None, f"{head} is not a message field"
        descriptor = message
    return descriptor.fields_by_name[name].cpp_type


def as_carried(path: str, value: Any) -> Any:
    """`value` as GenerateRequest's field `path` ("priority", "sampling.top_k", "token_ids.ids")
    carries it: a float rounded to 32 bits (past their range: infinite), an int (each one, of a
    repeated field) refused with ValueError outside the field's range, as protobuf refuses it; so
    that a request built without the message is the request the message would carry."""
    cpp_type = _cpp_type(path)
    if cpp_type == FieldDescriptor.CPPTYPE_FLOAT:
        return ctypes.c_float(value).value
    bounds = _INT_RANGES.get(cpp_type)
    if bounds is not None:
        low, high = bounds
        for v in (value if isinstance(value, list) else (value,)):
            if not low <= v <= high:
                raise ValueError(f"Value out of range: {v}")
    return value
