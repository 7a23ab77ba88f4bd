"""A per-request outbox with one slot: outputs that arrive while the client is still reading
the previous one are merged, so a slow client never stalls the engine or grows a queue."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from enum import Enum

from vmesh.services.common.output_accumulator import OutputAccumulator
from vmesh.services.common.types import FinishReason, StreamOutput, TokenLogprobs, Usage

SERVER_ABORTED = "the server aborted the request before it finished; try again"


class LostService(str, Enum):
    SCHEDULER = "scheduler"
    DETOKENIZER = "detokenizer"


@dataclass
class PendingOutput(OutputAccumulator[TokenLogprobs]):
    """One output, or several merged while the client read the one before (`delta_text`
    matters only to the merged ones: the outbox's)."""

    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: str = ""
    # With an error, the service the request lost (None for any other error): it may be
    # submitted again with what it has received (a failover).
    lost: LostService | None = None
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # the first tokens' output's, if asked
    embedding: list[float] = field(default_factory=list)  # the first token's output's, for an embedding request

    @classmethod
    def received(cls, output: StreamOutput) -> PendingOutput:
        """An output as a detokenizer sent it. An error ends the request (or its path, for a
        failover) with no finish reason and no usage; so does an abort on the server's side (the
        finish reason ABORT): its text is no complete answer, and both APIs fail it as UNAVAILABLE."""
        error = output.error or (SERVER_ABORTED if output.finish_reason is FinishReason.ABORT else "")
        if error:
            return cls(text=output.text, token_ids=output.token_ids, logprobs=output.logprobs, error=error,
                       lost=LostService.SCHEDULER if output.resumable else None)
        out = cls(text=output.text, token_ids=output.token_ids, logprobs=output.logprobs,
                  finish_reason=output.finish_reason, prompt_logprobs=output.prompt_logprobs,
                  embedding=output.embedding)
        if out.finished:
            out.usage = output.usage
        return out

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or bool(self.error)

    def merge(self, later: PendingOutput) -> None:
        self.extend(later.text, later.token_ids, later.logprobs)
        self.finish_reason = later.finish_reason or self.finish_reason
        self.usage = later.usage or self.usage
        self.error = later.error or self.error
        self.lost = later.lost or self.lost
        self.prompt_logprobs = self.prompt_logprobs or later.prompt_logprobs
        self.embedding = self.embedding or later.embedding


class Outbox:
    def __init__(self, delta_text: bool):
        self.delta_text = delta_text  # the request's output mode is delta (else its texts are whole)
        self.pending: PendingOutput | None = None
        self.ready = asyncio.Event()
        self.detokenizer: str | None = None
        self.group: object | None = None  # the scheduler group that took the request
        self.closed = False  # its last output (a finish or an error) is in: later news is moot
        # What reached this outbox, hence the client: a failover resubmits the tokens and tells
        # the next replica how much of their text not to send again.
        self.received = OutputAccumulator[TokenLogprobs](delta_text)
        self.resumed_text_length = 0  # a resumed stream's: text the client had before (delta mode)

    def resume(self, token_ids: list[int], text_length: int) -> None:
        """The client had these tokens, and this much of their text, before its stream was resumed here."""
        self.received.token_ids[:] = token_ids
        self.resumed_text_length = text_length if self.delta_text else 0  # other modes resend the whole text

    @property
    def received_token_ids(self) -> list[int]:
        return self.received.token_ids

    @property
    def received_text_length(self) -> int:
        """Characters; outside delta mode, the latest text's."""
        return self.resumed_text_length + len(self.received.text)

    def put(self, out: PendingOutput) -> None:
        if self.closed:  # e.g. a scheduler lost after this request already finished
            return
        self.closed = out.finished
        if not out.error:
            self.received.extend(out.text, out.token_ids)
        if self.pending is None:  # the output is the outbox's now: taken as it is, not copied into a new one
            out.delta_text = self.delta_text
            self.pending = out
        else:
            self.pending.merge(out)
        self.ready.set()

    def reopen(self) -> None:
        """The request failed over (resubmitted after a resumable error): outputs flow again."""
        self.closed = False

    async def get(self) -> PendingOutput:
        await self.ready.wait()
        self.ready.clear()
        out, self.pending = self.pending, None
        assert out is not None, "ready is set only with an output pending"
        return out
