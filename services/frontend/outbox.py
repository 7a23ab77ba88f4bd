"""A per-request outbox with one slot: outputs that arrive while the client is still reading
the previous one are merged, so a slow client never stalls the engine or grows a queue."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from vmesh.services.common.types import FinishReason, TokenLogprobs, Usage


@dataclass
class PendingOutput:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: str = ""
    # With an error, the service the request lost ("scheduler" or "detokenizer"; "" for any other
    # error): it may be submitted again with what it has received (a failover).
    lost: str = ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or bool(self.error)


class Outbox:
    def __init__(self, delta_text: bool):
        self.delta_text = delta_text  # delta mode concatenates text; other modes keep the latest
        self.pending: PendingOutput | None = None
        self.ready = asyncio.Event()
        self.detokenizer: str | None = None
        self.group: object | None = None  # the scheduler group that took the request
        self.closed = False  # its last output (a finish or an error) is in: later news is moot
        # What reached this outbox, hence the client: a failover resubmits the tokens and tells
        # the next replica how much of their text not to send again.
        self.received_token_ids: list[int] = []
        self.received_text_length = 0  # characters; in cumulative mode the latest text's length

    def put(self, out: PendingOutput) -> None:
        if self.closed:  # e.g. a scheduler lost after this request already finished
            return
        self.closed = out.finished
        if not out.error:
            self.received_token_ids += out.token_ids
            self.received_text_length = (self.received_text_length + len(out.text) if self.delta_text
                                         else len(out.text))
        if self.pending is None:
            self.pending = out
        else:
            merged = self.pending
            merged.text = merged.text + out.text if self.delta_text else out.text
            merged.token_ids += out.token_ids
            merged.logprobs += out.logprobs
            merged.finish_reason = out.finish_reason or merged.finish_reason
            merged.usage = out.usage or merged.usage
            merged.error = out.error or merged.error
            merged.lost = out.lost or merged.lost
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
