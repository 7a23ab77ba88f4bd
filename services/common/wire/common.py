"""What common.proto gives every link: the enums' codes, and logprobs as columns with the one
rule for which request owns each row."""

from __future__ import annotations

from collections.abc import Iterable, MutableSequence, Sequence

from vmesh.services.common.types import FinishReason, OutputMode, TokenLogprobs, TraceContext
from vmesh.v1 import common_pb2

OUTPUT_MODES_PB = {
    OutputMode.DELTA: common_pb2.OUTPUT_MODE_DELTA,
    OutputMode.CUMULATIVE: common_pb2.OUTPUT_MODE_CUMULATIVE,
    OutputMode.FINAL_ONLY: common_pb2.OUTPUT_MODE_FINAL_ONLY,
}
_OUTPUT_MODES: dict[int, OutputMode] = {code: mode for mode, code in OUTPUT_MODES_PB.items()}

FINISH_REASONS_PB = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
}
_FINISH_REASONS: dict[int, FinishReason | None] = {code: reason for reason, code in FINISH_REASONS_PB.items()}


def output_mode_from_proto(code: int) -> OutputMode:
    return _OUTPUT_MODES.get(code, OutputMode.DELTA)  # UNSPECIFIED (or a newer one) is DELTA


def finish_to_proto(reason: FinishReason | None) -> common_pb2.FinishReason:
    return FINISH_REASONS_PB[reason]


def finish_from_proto(code: int) -> FinishReason | None:
    return _FINISH_REASONS.get(code)


def pack_logprobs(rows: Iterable[TokenLogprobs], columns: common_pb2.LogprobColumns) -> None:
    """Append rows to columns, which may already hold others' (a batch packs request after request)."""
    for row in rows:
        columns.sampled_logprobs.append(row.logprob)
        columns.sampled_ranks.append(row.rank)
        columns.num_top.append(len(row.top_token_ids))
        columns.top_token_ids.extend(row.top_token_ids)
        columns.top_logprobs.extend(row.top_logprobs)


def unpack_logprobs(columns: common_pb2.LogprobColumns) -> list[TokenLogprobs]:
    """Every row, in order; the carrying message says which request owns each."""
    # Repeated fields index slowly one by one; plain lists first.
    logprobs, ranks, counts = list(columns.sampled_logprobs), list(columns.sampled_ranks), list(columns.num_top)
    top_ids, top_lps = list(columns.top_token_ids), list(columns.top_logprobs)
    rows = []
    offset = 0
    for logprob, rank, n in zip(logprobs, ranks, counts):
        rows.append(TokenLogprobs(logprob, rank, top_ids[offset:offset + n], top_lps[offset:offset + n]))
        offset += n
    return rows


# Which request owns each row is said one of two ways: by the owner's handle beside each row
# (ExecuteResponse, DetokenizeRequest: logprobs_handles), or by a row count per request, in
# request order (SubscribeResponse: num_logprobs_rows). These two functions are the one rule:
# owners are handles, or request indexes for a count encoding (owners_of_counts).


def pack_owned(owned: Iterable[tuple[int, Sequence[TokenLogprobs]]], columns: common_pb2.LogprobColumns) -> list[int]:
    """Pack each owner's rows, in order; returns the owner of each row."""
    owners: list[int] = []
    for owner, rows in owned:
        owners.extend([owner] * len(rows))
        pack_logprobs(rows, columns)
    return owners


def unpack_owned(owners: Sequence[int], columns: common_pb2.LogprobColumns) -> dict[int, list[TokenLogprobs]]:
    """Each owner's rows, in order."""
    by_owner: dict[int, list[TokenLogprobs]] = {}
    for owner, row in zip(owners, unpack_logprobs(columns)):
        by_owner.setdefault(owner, []).append(row)
    return by_owner


def owners_of_counts(counts: Iterable[int]) -> list[int]:
    """A row count per request as owners: each row owned by its request's index."""
    return [index for index, count in enumerate(counts) for _ in range(count)]


# Embedding vectors travel flattened in one packed float field, all of the model's hidden size:
# ExecuteResponse and DetokenizeRequest name each vector's owner (embedding_handles),
# SubscribeResponse gives each key's vector size (0: none).


def pack_vectors(owned: Iterable[tuple[int, Sequence[float]]], flat: MutableSequence[float]) -> list[int]:
    """Append each owner's non-empty vector to `flat` (a packed repeated float); returns their owners."""
    owners: list[int] = []
    for owner, vector in owned:
        if vector:
            owners.append(owner)
            flat.extend(vector)
    return owners


def unpack_vectors(owners: Sequence[int], flat: Sequence[float]) -> dict[int, list[float]]:
    """Each owner's vector: `flat` split in len(owners) equal parts."""
    if not owners:
        return {}
    values = list(flat)  # repeated fields index slowly
    size = len(values) // len(owners)
    return {owner: values[i * size:(i + 1) * size] for i, owner in enumerate(owners)}


def trace_context_to_proto(context: TraceContext) -> common_pb2.TraceContext:
    return common_pb2.TraceContext(traceparent=context.traceparent, tracestate=context.tracestate)
