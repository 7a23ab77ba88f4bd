"""Logprobs of generated tokens: the one Python type every service holds them in, and the one
pack and unpack between it and the columns (common.proto's LogprobColumns) every internal
message carries them as. The public API's per-token message is built here too, so that the
frontend speaks the same type until its response goes out."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from vmesh.v1 import common_pb2, frontend_pb2


@dataclass
class TokenLogprobs:
    """One generated token: its logprob and rank, and the request's top-N alternatives."""
    logprob: float
    rank: int  # 1: the most likely token
    top_token_ids: list[int]
    top_logprobs: list[float]  # alongside top_token_ids, most likely first


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


def to_public(rows: Iterable[TokenLogprobs]) -> list[frontend_pb2.GeneratedTokenLogprobs]:
    """The public API's form (frontend.proto), which clients read row by row."""
    return [frontend_pb2.GeneratedTokenLogprobs(
        logprob=row.logprob, rank=row.rank,
        top=[frontend_pb2.TokenLogprob(token_id=t, logprob=lp) for t, lp in zip(row.top_token_ids, row.top_logprobs)])
        for row in rows]
