"""The model's text read back as tool calls, incrementally, one parser per format
(services/frontend/tool_parsers/<format>.py, behind base.ToolCallParser), the served one chosen
by registry.choose_tool_format. Each parser is fed the text deltas of one choice and answers
content deltas and tool-call deltas; the non-streamed response is the same parser fed the whole
text (`parse_text`), so that what the streamed deltas assemble to and the non-streamed message
are one result however the text was split.

- hermes, mistral, llama3_json, pythonic: `tool_choice` "auto" (each module says its format).
- forced.JsonToolCallParser: "required" / a named function, the JSON array tool_calls.tool_choice_schema
  enforces, whatever the served format."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vmesh.services.frontend.tool_parsers.base import (
    ContentDelta,
    Delta,
    ToolCallDelta,
    ToolCallParser,
    new_call_id,
)
from vmesh.services.frontend.tool_parsers.forced import JsonToolCallParser
from vmesh.services.frontend.tool_parsers.hermes import HermesToolCallParser
from vmesh.services.frontend.tool_parsers.llama3_json import Llama3JsonToolCallParser
from vmesh.services.frontend.tool_parsers.mistral import MistralToolCallParser
from vmesh.services.frontend.tool_parsers.pythonic import PythonicToolCallParser
from vmesh.services.frontend.tool_parsers.registry import (
    FORMATS,
    TOOL_CALL_PARSERS,
    ServedToolFormat,
    ToolReader,
    choose_tool_format,
)

__all__ = ["FORMATS", "TOOL_CALL_PARSERS", "ContentDelta", "Delta", "HermesToolCallParser", "JsonToolCallParser",
           "Llama3JsonToolCallParser", "MistralToolCallParser", "PythonicToolCallParser", "ServedToolFormat",
           "ToolCallDelta", "ToolCallParser", "ToolReader", "assemble", "choose_tool_format", "coalesce",
           "make_parser", "new_call_id", "parse_text"]


def make_parser(reader: ToolReader | None) -> ToolCallParser | None:
    """The parser a chat request's outputs go through; None: plain content."""
    if reader is None or not reader.plan.parses_calls:
        return None
    return reader.parser()


def coalesce(deltas: Iterable[Delta]) -> list[Delta]:
    """Adjacent deltas of one kind merged (content with content, one call's argument fragments)."""
    out: list[Delta] = []
    for d in deltas:
        last = out[-1] if out else None
        if isinstance(d, ContentDelta) and isinstance(last, ContentDelta):
            out[-1] = ContentDelta(last.text + d.text)
        elif (isinstance(d, ToolCallDelta) and isinstance(last, ToolCallDelta) and d.id is None
              and last.index == d.index):
            out[-1] = ToolCallDelta(last.index, last.arguments + d.arguments, last.id, last.name)
        else:
            out.append(d)
    return out


def assemble(deltas: Iterable[Delta]) -> tuple[str, list[dict[str, Any]]]:
    """The content and OpenAI's `tool_calls` the deltas add up to."""
    content: list[str] = []
    calls: list[dict[str, Any]] = []
    for d in deltas:
        if isinstance(d, ContentDelta):
            content.append(d.text)
        elif d.id is not None:
            calls.append({"id": d.id, "type": "function", "function": {"name": d.name, "arguments": d.arguments}})
        else:
            calls[d.index]["function"]["arguments"] += d.arguments
    return "".join(content), calls


def parse_text(parser: ToolCallParser, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole output's message: (content, tool_calls); content None when there are only calls."""
    content, calls = assemble([*parser.feed(text), *parser.finish()])
    return (content or None) if calls else content, calls
