"""The public API (frontend.proto): how the core types a request's outputs arrive in are sent to clients."""

from __future__ import annotations

from collections.abc import Iterable

from vmesh.services.common.types import TokenLogprobs, Usage
from vmesh.v1 import frontend_pb2


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
