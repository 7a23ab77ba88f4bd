"""Structured outputs on the wire: the request and its compiled grammar survive every link that
enforces them, and the link towards the detokenizer leaves the compiled payload out."""

from __future__ import annotations

import pytest

from vmesh.services.common.step_types import NewRequest, StepPlan
from vmesh.services.common.types import (
    STRUCTURED_KINDS,
    CompiledGrammar,
    RequestRef,
    SamplingParams,
    StreamStart,
    StructuredOutput,
    TokenBatch,
)
from vmesh.services.common.wire import step, tokens
from vmesh.services.common.wire.sampling import sampling_from_proto, sampling_to_proto
from vmesh.v1 import common_pb2

GRAMMAR = CompiledGrammar(backend="xgrammar", key="ab" * 32, payload=b'{"grammar": "\x00\xff binary-safe"}')


def _reread(params: SamplingParams, **kwargs: bool) -> SamplingParams:
    wire = sampling_to_proto(params, **kwargs).SerializeToString()
    return sampling_from_proto(common_pb2.SamplingParams.FromString(wire))


@pytest.mark.parametrize("kind", STRUCTURED_KINDS)
def test_structured_and_grammar_round_trip(kind: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=32, stop=["\n"],
                            structured=StructuredOutput(kind, '{"type": "object"}', "llguidance"), grammar=GRAMMAR)
    assert _reread(params) == params


def test_unset_structured_and_grammar_read_as_none() -> None:
    params = sampling_from_proto(common_pb2.SamplingParams())
    assert params.structured is None and params.grammar is None
    pb = sampling_to_proto(SamplingParams())
    assert not pb.HasField("structured") and not pb.HasField("grammar")


def test_empty_backend_reads_as_auto_and_unknown_kind_as_empty() -> None:
    pb = common_pb2.SamplingParams(structured=common_pb2.StructuredOutput(kind=common_pb2.STRUCTURED_KIND_REGEX,
                                                                          source="a+"))
    assert sampling_from_proto(pb).structured == StructuredOutput("regex", "a+", "auto")
    pb.structured.kind = common_pb2.STRUCTURED_KIND_UNSPECIFIED
    assert sampling_from_proto(pb).structured == StructuredOutput("", "a+", "auto")  # admission refuses ""


def test_without_grammar_keeps_everything_else() -> None:
    params = SamplingParams(stop=["}"], structured=StructuredOutput("json_object"), grammar=GRAMMAR)
    reread = _reread(params, with_grammar=False)
    assert reread.grammar is None
    assert reread == SamplingParams(stop=["}"], structured=StructuredOutput("json_object"))


def test_the_worker_link_carries_the_grammar() -> None:
    params = SamplingParams(structured=StructuredOutput("regex", "[0-9]+"), grammar=GRAMMAR)
    plan = StepPlan(step=3, new_requests=[NewRequest(1, [5, 6], 2, params, [0])], scheduled_handles=[1],
                    num_scheduled_tokens=[2], new_block_ids=[0], num_new_blocks=[1])
    pb = step.plan_to_proto(plan)
    reread = step.plan_from_proto(type(pb).FromString(pb.SerializeToString()))
    assert reread.new_requests[0].sampling.grammar == GRAMMAR


def test_the_detokenizer_link_leaves_the_payload_out() -> None:
    params = SamplingParams(stop=["END"], structured=StructuredOutput("regex", "[0-9]+"), grammar=GRAMMAR)
    batch = TokenBatch(new_requests=[StreamStart(RequestRef("f", 1), [1, 2], params, 2, handle=4)])
    pb = tokens.to_proto(batch)
    assert not pb.new_requests[0].sampling.HasField("grammar")
    assert GRAMMAR.payload not in pb.SerializeToString()
    start = tokens.from_proto(type(pb).FromString(pb.SerializeToString())).new_requests[0]
    assert start.sampling.grammar is None and start.sampling.stop == ["END"]
    assert start.sampling.structured == params.structured
