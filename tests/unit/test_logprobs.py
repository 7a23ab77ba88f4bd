"""The one logprobs type and its one pack/unpack: rows survive the columns (and the wire) as they were."""

from __future__ import annotations

from vmesh.services.common.step_types import StepResult
from vmesh.services.common.types import TokenLogprobs
from vmesh.services.common.wire.common import pack_logprobs, unpack_logprobs
from vmesh.services.common.wire.public import logprobs_to_public
from vmesh.services.common.wire.step import result_from_proto, result_to_proto
from vmesh.v1 import common_pb2, detokenizer_pb2

# Values a float32 holds exactly, so that the wire's float columns give them back unchanged.
ROWS = [TokenLogprobs(-0.5, 1, [8, 9], [-0.5, -1.5]), TokenLogprobs(-2.25, 3, [], []),
        TokenLogprobs(-0.125, 2, [4, 1, 7], [-0.0625, -0.125, -4.0])]


def test_pack_then_unpack_gives_the_rows_back_through_serialized_bytes() -> None:
    columns = common_pb2.LogprobColumns()
    pack_logprobs(ROWS, columns)
    assert list(columns.num_top) == [2, 0, 3] and list(columns.top_token_ids) == [8, 9, 4, 1, 7]
    assert unpack_logprobs(common_pb2.LogprobColumns.FromString(columns.SerializeToString())) == ROWS


def test_packing_appends_after_rows_already_there() -> None:
    batch = detokenizer_pb2.SubscribeResponse()
    pack_logprobs(ROWS[:1], batch.logprobs)
    pack_logprobs(ROWS[1:], batch.logprobs)
    assert unpack_logprobs(batch.logprobs) == ROWS


def test_empty_columns_unpack_to_no_rows() -> None:
    assert unpack_logprobs(common_pb2.LogprobColumns()) == []


def test_step_result_round_trips_its_logprobs_over_the_worker_wire() -> None:
    result = StepResult(step=4, handles=[1, 2, 3], sampled_token_ids=[8, 5, 4], logprobs_handles=[1, 3, 3],
                        logprobs=ROWS)
    back = result_from_proto(result_to_proto(result))
    assert back.logprobs_handles == [1, 3, 3] and back.logprobs == ROWS


def test_public_form_keeps_each_row_and_its_top_entries_in_order() -> None:
    public = logprobs_to_public(ROWS)
    assert [(p.logprob, p.rank) for p in public] == [(r.logprob, r.rank) for r in ROWS]
    assert [[(t.token_id, t.logprob) for t in p.top] for p in public] == [
        list(zip(r.top_token_ids, r.top_logprobs)) for r in ROWS]
