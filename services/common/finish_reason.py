"""Why a request ended, as every service names it, and its wire code."""

from __future__ import annotations

from enum import Enum

from vmesh.v1 import common_pb2


class FinishReason(Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"


FINISH_REASONS_PB = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
}
FINISH_REASONS: dict[int, FinishReason | None] = {v: k for k, v in FINISH_REASONS_PB.items()}


def finish_name(code: int) -> str:
    """The reason's name for a wire code ("" while the request runs), as metrics and traces label it."""
    reason = FINISH_REASONS.get(code)
    return reason.value if reason else ""
