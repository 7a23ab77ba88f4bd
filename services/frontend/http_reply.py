"""One HTTP request's reply as the OpenAI routes build it (http_server.py): its id, its choices
so far, what its chunks say besides the outputs, and the Server-Sent Events they are written as."""

from __future__ import annotations

import json
from dataclasses import InitVar, dataclass, field
from typing import Any

from vmesh.services.common.generation import GenerationOutput
from vmesh.services.common.resume import ResumePoint, progress_entry
from vmesh.services.frontend import openai_responses as render
from vmesh.services.frontend import responses_api
from vmesh.services.frontend.structured_requests import BACKEND_HEADER
from vmesh.services.frontend.tool_parsers import ToolReader

# A streamed chunk: its fields, or (Reply.plain_chunk) its JSON already rendered.
Chunk = dict[str, Any] | str
# json.dumps(payload, separators=(",", ":")) without building an encoder for every event.
_COMPACT = json.JSONEncoder(separators=(",", ":"))
_json_string = json.encoder.encode_basestring_ascii  # a str as _COMPACT writes it (ASCII, escaped)


def sse(payload: Chunk, event_id: str = "") -> str:
    data = f"data: {payload if isinstance(payload, str) else _COMPACT.encode(payload)}\n\n"
    return f"id: {event_id}\n{data}" if event_id else data


@dataclass
class Reply:
    """One HTTP request's reply as it is built: what its body, or each of its streamed chunks, says
    besides the outputs (`choices`: one per prompt and copy, in order)."""

    model: str
    chat: bool
    prompts: InitVar[int]
    n: int
    stream: bool
    include_usage: bool  # streamed: a last chunk with the usage
    want_logprobs: bool
    aliases: dict[str, str]  # the request's own names of fields (for errors' `param`)
    tools: ToolReader | None = None  # chat: what its tool fields asked for, read in the served format
    responses: responses_api.ResponsesView | None = None  # a Responses API reply, built over this chat one
    structured_backend: str = ""  # the grammar backend that constrains the output ("": none)
    echo: render.Echo | None = None  # completions' echo
    want_prompt_logprobs: bool = False  # vLLM's prompt_logprobs
    skip_special_tokens: bool = True  # the requests' (completions' text_offset counts what the text holds)
    request_id: str = field(init=False)
    created: int = field(init=False)
    choices: list[render.Choice] = field(init=False)
    # Each choice's point of departure: its resume key, and what the client had when it resumed.
    starts: list[ResumePoint] = field(init=False, default_factory=list)
    resuming: bool = field(init=False, default=False)
    event_ids: bool = field(init=False, default=False)  # streamed events carry ids (http_resume.py)
    _chunk_head: str | None = field(init=False, default=None, repr=False)  # plain_chunk's, rendered once
    _chunk_tail: str = field(init=False, default="", repr=False)

    def __post_init__(self, prompts: int) -> None:
        self.request_id = render.new_id("chatcmpl" if self.chat else "cmpl")
        self.created = render.now()
        self.choices = [render.Choice() for _ in range(prompts * self.n)]

    def note(self, out: GenerationOutput) -> None:
        self.structured_backend = self.structured_backend or out.structured_backend

    @property
    def headers(self) -> dict[str, str]:
        return {BACKEND_HEADER: self.structured_backend} if self.structured_backend else {}

    def event_id(self) -> str:
        """How far the client is once it has every event so far (http_resume.py)."""
        if len(self.choices) == 1:  # most replies: no generator and join for every event
            return _progress(self.starts[0], self.choices[0])
        return ",".join(_progress(start, choice) for start, choice in zip(self.starts, self.choices, strict=True))

    def chunk(self, choices: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
        """`fields`: the usage chunk's usage; where the client asked for one, every other chunk
        says `"usage": null`, as OpenAI's do."""
        if self.include_usage and "usage" not in fields:
            fields["usage"] = None
        return {"id": self.request_id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, **fields}

    def plain_chunk(self, index: int, text: str, finish_reason: str | None) -> str:
        """The JSON of `chunk` with one choice and no logprobs, byte for byte, written straight from
        the reply's fields rendered once: most streamed events are this one, one per token per
        client. Chat's delta holds the text only when there is some; a completion's always."""
        if self._chunk_head is None:
            head = _COMPACT.encode(self.chunk([]))
            cut = head.index('"choices":[]') + len('"choices":[')
            # everything before the choices' entries, and after them
            self._chunk_head, self._chunk_tail = head[:cut], head[cut:]
        if self.chat:
            body = f'"delta":{{"content":{_json_string(text)}}}' if text else '"delta":{}'
        else:
            body = f'"text":{_json_string(text)}'
        finish = _json_string(finish_reason) if finish_reason is not None else "null"
        entry = f'{{"index":{index},{body},"logprobs":null,"finish_reason":{finish}}}'
        return f"{self._chunk_head}{entry}{self._chunk_tail}"


def _progress(start: ResumePoint, choice: render.Choice) -> str:
    """A choice's entry of the event id: where it started, plus what it has received since."""
    return progress_entry(start.key, start.num_output_tokens + len(choice.token_ids),
                          start.text_length + len(choice.text), start.finished or choice.finish_reason is not None)
