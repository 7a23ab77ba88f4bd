"""A request's outbox: outputs merge while the client reads, and nothing after its last one
(a finish or an error) changes what the client gets."""

from __future__ import annotations

import asyncio

import pytest

from vmesh.services.common.types import FinishReason
from vmesh.services.frontend.outbox import Outbox, PendingOutput

STOP = FinishReason.STOP


@pytest.mark.parametrize("delta_text, texts, merged", [
    (True, ("a", "b"), "ab"),  # new text each time: appended
    (False, ("He", "Hello"), "Hello"),  # the whole text each time: the first taken as it is, then replaced
])
def test_outputs_merge_until_read(delta_text: bool, texts: tuple[str, str], merged: str):
    async def main():
        box = Outbox(delta_text=delta_text)
        box.put(PendingOutput(text=texts[0], token_ids=[1]))
        box.put(PendingOutput(text=texts[1], token_ids=[2]))
        return await box.get()

    out = asyncio.run(main())
    assert out.text == merged and out.token_ids == [1, 2] and not out.finished


def test_an_error_after_the_finish_does_not_spoil_a_finished_request():
    """A scheduler lost (or a replica failing) just after a request finished, while its last
    output waits for a slow client: the client still gets its finished output."""
    async def main():
        box = Outbox(delta_text=True)
        box.put(PendingOutput(text="done", token_ids=[3], finish_reason=STOP))
        box.put(PendingOutput(error="the scheduler serving this request went away"))
        first = await box.get()
        box.put(PendingOutput(error="late"))  # after the client read the finish
        return first, box.pending

    first, left = asyncio.run(main())
    assert first.finish_reason == STOP and first.error == "" and first.text == "done"
    assert left is None


def test_nothing_follows_an_error():
    async def main():
        box = Outbox(delta_text=True)
        box.put(PendingOutput(error="replica lost"))
        box.put(PendingOutput(text="x", token_ids=[1], finish_reason=STOP))
        return await box.get()

    out = asyncio.run(main())
    assert out.error == "replica lost" and out.token_ids == []


def test_what_reached_the_client_is_counted_for_a_failover():
    delta, cumulative = Outbox(delta_text=True), Outbox(delta_text=False)
    for box, texts in ((delta, ["He", "llo", ""]), (cumulative, ["He", "Hello", "Hello"])):
        for i, text in enumerate(texts):
            box.put(PendingOutput(text=text, token_ids=[i]))
        box.put(PendingOutput(error="lost", lost="detokenizer"))  # counts nothing, closes
        assert box.closed and box.received_token_ids == [0, 1, 2] and box.received_text_length == 5
        box.reopen()
        box.put(PendingOutput(text="!" if box is delta else "Hello!", token_ids=[3]))
        assert box.received_token_ids == [0, 1, 2, 3] and box.received_text_length == 6
