"""The scheduler -> detokenizer link: TokenBatch <-> DetokenizeRequest, columns by stream handle."""

from __future__ import annotations

from vmesh.services.common.types import RequestRef, StepTokens, StreamStart, TokenBatch, TraceContext
from vmesh.services.common.wire.common import (
    finish_from_proto,
    finish_to_proto,
    pack_owned,
    pack_vectors,
    unpack_owned,
    unpack_vectors,
)
from vmesh.services.common.wire.sampling import sampling_from_proto, sampling_to_proto
from vmesh.v1 import common_pb2, detokenizer_pb2


def _start_to_proto(s: StreamStart) -> detokenizer_pb2.DetokenizerRequestInfo:
    return detokenizer_pb2.DetokenizerRequestInfo(
        handle=s.handle, frontend_id=s.ref.frontend_id, frontend_key=s.ref.frontend_key, prompt_tail=s.prompt_tail,
        sampling=sampling_to_proto(s.sampling, with_grammar=False), num_prompt_tokens=s.num_prompt_tokens,
        trace_context=common_pb2.TraceContext(traceparent=s.trace_context.traceparent,
                                              tracestate=s.trace_context.tracestate)
        if s.trace_context.traceparent else None,
        resumed_output_token_ids=s.resumed_output_token_ids, resumed_text_length=s.resumed_text_length)


def _start_from_proto(pb: detokenizer_pb2.DetokenizerRequestInfo) -> StreamStart:
    return StreamStart(
        RequestRef(pb.frontend_id, pb.frontend_key), list(pb.prompt_tail), sampling_from_proto(pb.sampling),
        pb.num_prompt_tokens, handle=pb.handle,
        trace_context=TraceContext(pb.trace_context.traceparent, pb.trace_context.tracestate),
        resumed_output_token_ids=list(pb.resumed_output_token_ids), resumed_text_length=pb.resumed_text_length)


def to_proto(batch: TokenBatch) -> detokenizer_pb2.DetokenizeRequest:
    pb = detokenizer_pb2.DetokenizeRequest(new_requests=[_start_to_proto(s) for s in batch.new_requests])
    for r in batch.requests:
        pb.handles.append(r.handle)
        pb.num_tokens.append(len(r.token_ids))
        pb.token_ids.extend(r.token_ids)
        pb.finish_reasons.append(finish_to_proto(r.finish_reason))
        pb.num_cached_prompt_tokens.append(r.num_cached_prompt_tokens)
        pb.errors.append(r.error)
    pb.logprobs_handles.extend(pack_owned(((r.handle, r.logprobs) for r in batch.requests), pb.logprobs))
    pb.prompt_logprobs_handles.extend(pack_owned(((r.handle, r.prompt_logprobs) for r in batch.requests),
                                                 pb.prompt_logprobs))
    pb.embedding_handles.extend(pack_vectors(((r.handle, r.embedding) for r in batch.requests), pb.embeddings))
    return pb


def from_proto(pb: detokenizer_pb2.DetokenizeRequest) -> TokenBatch:
    logprobs = unpack_owned(pb.logprobs_handles, pb.logprobs)
    prompt_logprobs = unpack_owned(pb.prompt_logprobs_handles, pb.prompt_logprobs)
    embeddings = unpack_vectors(pb.embedding_handles, pb.embeddings)
    token_ids, num_tokens = list(pb.token_ids), list(pb.num_tokens)  # repeated fields index slowly
    errors = list(pb.errors) or [""] * len(pb.handles)  # a sender that fails nothing may leave them out
    requests = []
    offset = 0
    for i, handle in enumerate(pb.handles):
        n = num_tokens[i]
        requests.append(StepTokens(handle, token_ids[offset:offset + n], finish_from_proto(pb.finish_reasons[i]),
                                   pb.num_cached_prompt_tokens[i], logprobs.get(handle, []), errors[i],
                                   prompt_logprobs.get(handle, []), embeddings.get(handle, [])))
        offset += n
    return TokenBatch([_start_from_proto(s) for s in pb.new_requests], requests)
