"""Embedding requests on the wire: SamplingParams.pooling decodes to what was sent (an unknown
pooling type to LAST), and each link carries the pooled vectors as packed float32 beside the
right request, only for the requests that have one."""

from __future__ import annotations

import struct

from vmesh.services.common.generation import GenerationOutput
from vmesh.services.common.step_types import StepResult
from vmesh.services.common.types import (
    OutputBatch,
    Pooling,
    PoolingType,
    SamplingParams,
    StepTokens,
    StreamOutput,
    TokenBatch,
)
from vmesh.services.common.wire import outputs, tokens
from vmesh.services.common.wire.public import output_to_public
from vmesh.services.common.wire.sampling import sampling_from_proto, sampling_to_proto
from vmesh.services.common.wire.step import result_from_proto, result_to_proto
from vmesh.v1 import common_pb2, worker_pb2

# Exactly representable in float32, so that equality holds after the wire's float32.
VECTOR_A = [0.5, -1.25, 3.0]
VECTOR_B = [2.0, 0.0, -0.125]


def test_pooling_round_trips_and_an_unknown_type_reads_as_last() -> None:
    for pooling in [Pooling(t, normalize) for t in PoolingType for normalize in (True, False)]:
        params = SamplingParams(max_tokens=1, pooling=pooling)
        sent = common_pb2.SamplingParams.FromString(sampling_to_proto(params).SerializeToString())
        assert sampling_from_proto(sent) == params
    assert sampling_from_proto(common_pb2.SamplingParams()).pooling is None
    unknown = common_pb2.SamplingParams(pooling=common_pb2.Pooling(type=99, normalize=False))
    assert sampling_from_proto(unknown).pooling == Pooling(PoolingType.LAST, normalize=False)


def test_the_worker_result_carries_each_vector_packed_beside_its_handle() -> None:
    result = StepResult(step=3, handles=[4, 7, 9], sampled_token_ids=[1, 2, 3], embeddings={9: VECTOR_A, 4: VECTOR_B})
    pb = result_to_proto(result)
    # Packed: one length-delimited run of little-endian float32s, not one tag per value.
    assert struct.pack("<6f", *VECTOR_A, *VECTOR_B) in pb.SerializeToString()
    decoded = result_from_proto(worker_pb2.ExecuteResponse.FromString(pb.SerializeToString()))
    assert decoded.embeddings == {9: VECTOR_A, 4: VECTOR_B}
    assert result_from_proto(result_to_proto(StepResult(step=0, handles=[1], sampled_token_ids=[5]))).embeddings == {}


def test_the_detokenizer_links_carry_the_vector_with_its_request() -> None:
    batch = TokenBatch(requests=[StepTokens(5, [1]), StepTokens(6, [2], embedding=VECTOR_A)])
    sent = tokens.to_proto(batch)
    decoded = tokens.from_proto(type(sent).FromString(sent.SerializeToString()))
    assert [r.embedding for r in decoded.requests] == [[], VECTOR_A]
    out = OutputBatch([StreamOutput(11, "", [1], None, 3, 1, 0, embedding=VECTOR_B),
                       StreamOutput(12, "x", [2], None, 3, 1, 0)])
    wire = outputs.to_proto(out)
    decoded_out = outputs.from_proto(type(wire).FromString(wire.SerializeToString()))
    assert [o.embedding for o in decoded_out.outputs] == [VECTOR_B, []]


def test_the_public_api_gives_the_vector_in_the_response_with_the_first_token() -> None:
    first = output_to_public(GenerationOutput("r", "", [5], [], embedding=VECTOR_A))
    assert list(first.embedding) == VECTOR_A
    assert list(output_to_public(GenerationOutput("r", "x", [6], [])).embedding) == []
