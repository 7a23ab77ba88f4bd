"""The Responses API's streamed events (response.created ... response.completed), made from the
chat completion chunks that serve the request (http_server's chat stream, its usage chunk last):
text deltas become a message item's output_text deltas, tool-call deltas become function_call
items and their argument deltas, and the last event carries the whole Response, which equals
the one a non-streamed request gets."""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

from vmesh.services.frontend import openai_protocol as oai
from vmesh.services.frontend.errors import RequestError
from vmesh.services.frontend.responses_api import (
    ResponsesView,
    function_call_item,
    message_item,
    new_id,
    output_text,
    response_status,
    responses_usage,
)

logger = logging.getLogger(__name__)

Event = dict[str, Any]


def sse(event: Event) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"


class ResponseEvents:
    """One streamed response's events, in order, each with its sequence number."""

    def __init__(self, view: ResponsesView):
        self.view = view
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # the output, in order, as far as it has come
        self.open: dict[str, Any] | None = None  # the item that deltas now extend
        self.calls: dict[int, dict[str, Any]] = {}  # by the chat tool call's index
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def _at(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.items.index(item)}

    def start(self) -> Iterator[Event]:
        snapshot = self.view.response("in_progress", [], None)
        yield self._event("response.created", response=snapshot)
        yield self._event("response.in_progress", response=snapshot)

    def _add(self, item: dict[str, Any]) -> Iterator[Event]:
        self.items.append(item)
        self.open = item
        yield self._event("response.output_item.added", output_index=len(self.items) - 1, item=copy.deepcopy(item))

    def _open_message(self) -> Iterator[Event]:
        yield from self._close()
        # A second message (text after a tool call) gets an id of its own.
        used = any(i["type"] == "message" for i in self.items)
        item = message_item(new_id("msg") if used else self.view.message_id, None, "in_progress")
        yield from self._add(item)
        part = output_text("")
        item["content"].append(part)
        yield self._event("response.content_part.added", **self._at(item), content_index=0, part=copy.deepcopy(part))

    def _close(self, status: str = "completed") -> Iterator[Event]:
        item, self.open = self.open, None
        if item is None:
            return
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            yield self._event("response.output_text.done", **self._at(item), content_index=0, text=part["text"],
                              logprobs=[])
            yield self._event("response.content_part.done", **self._at(item), content_index=0, part=copy.deepcopy(part))
        else:
            yield self._event("response.function_call_arguments.done", **self._at(item),
                              arguments=item["arguments"])
        yield self._event("response.output_item.done", output_index=self.items.index(item), item=copy.deepcopy(item))

    def _text(self, text: str) -> Iterator[Event]:
        if self.open is None or self.open["type"] != "message":
            yield from self._open_message()
        item = self.open
        assert item is not None
        item["content"][0]["text"] += text
        yield self._event("response.output_text.delta", **self._at(item), content_index=0, delta=text, logprobs=[])

    def _tool_call(self, delta: dict[str, Any]) -> Iterator[Event]:
        index = delta.get("index", 0)
        function = delta.get("function") or {}
        item = self.calls.get(index)
        if item is None:
            yield from self._close()
            item = self.calls[index] = function_call_item(new_id("fc"), delta.get("id") or new_id("call"),
                                                          function.get("name") or "", "", "in_progress")
            yield from self._add(item)
        elif item is not self.open:  # a call resumed after another began: OpenAI's calls do not interleave
            raise RequestError(oai.Code.INTERNAL, f"tool call {index} resumed after the next one began")
        fragment = function.get("arguments") or ""
        if fragment:
            item["arguments"] += fragment
            yield self._event("response.function_call_arguments.delta", **self._at(item), delta=fragment)

    def chunk(self, chunk: dict[str, Any]) -> Iterator[Event]:
        """The events of one chat completion chunk."""
        if chunk.get("usage"):
            self.usage = responses_usage(chunk["usage"])
        for choice in chunk.get("choices", ()):
            delta = choice.get("delta") or {}
            if delta.get("content"):
                yield from self._text(delta["content"])
            for call in delta.get("tool_calls") or ():
                yield from self._tool_call(call)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason

    def finish(self) -> Iterator[Event]:
        """The last events: the open item closes, and the whole response."""
        status = response_status(self.finish_reason)
        if not self.items:  # nothing said: an empty message, as a response that is not streamed has
            yield from self._open_message()
        yield from self._close(status)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        yield self._event(kind, response=self.view.response(status, self.items, self.usage))

    def error(self, body: dict[str, Any]) -> Event:
        """`body`: OpenAI's error body (openai_protocol.error_body)."""
        error = body["error"]
        return self._event("error", code=error.get("code") or error["type"], message=error["message"],
                           param=error.get("param"))


async def stream(view: ResponsesView, chunks: AsyncIterator[dict[str, Any]],
                 aliases: dict[str, str]) -> AsyncIterator[str]:
    """The SSE text of a streamed response over the chat chunks that serve it. A failure after
    the response has started is an `error` event, the stream's last."""
    events = ResponseEvents(view)
    for event in events.start():
        yield sse(event)
    try:
        async for chunk in chunks:
            for event in events.chunk(chunk):
                yield sse(event)
        for event in events.finish():
            yield sse(event)
    except RequestError as exc:
        yield sse(events.error(oai.request_error_body(exc, aliases)[1]))
    except Exception as exc:
        logger.exception("Responses stream failed")
        yield sse(events.error(oai.error_body(f"internal error: {type(exc).__name__}", "internal_error")))
