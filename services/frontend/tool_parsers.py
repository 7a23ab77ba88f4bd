"""The model's text read back as tool calls, incrementally: each parser is fed the text deltas of
one choice and answers content deltas and tool-call deltas (a call's first delta has its index,
id and name; later ones carry fragments of its arguments). The non-streamed response is the same
parser fed the whole text (`parse_text`), so that what the streamed deltas assemble to and the
non-streamed message are one result however the text was split.

- HermesToolCallParser ("auto"): <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks
  anywhere in the text. A call is emitted once its block has closed and its JSON reads as a call
  of a known tool: a block that does not (malformed JSON, an unknown name, no closing tag by the
  end) stays content, as written. Whitespace around calls is part of their syntax, not content.
- JsonToolCallParser ("required" / a named function): the JSON array tool_calls.tool_choice_schema
  enforces, `[{"name": ..., "arguments": {...}}, ...]`; the grammar guarantees every prefix is
  valid, so each call's arguments stream as the model writes them."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from vmesh.services.common.tool_prompt import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from vmesh.services.frontend.tool_calls import ToolPlan

_WHITESPACE = " \t\r\n"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A call's first delta has `id` and `name` (and arguments ""); later ones only `arguments`."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


Delta = ContentDelta | ToolCallDelta


class ToolCallParser(Protocol):
    calls: int  # how many calls it has emitted

    def feed(self, text: str) -> list[Delta]: ...

    def finish(self) -> list[Delta]: ...


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that begins `tag` (a tag split across deltas)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _inside_string(text: str) -> bool:
    """Whether JSON text ends inside a string (a closing tag there is the string's, not the call's)."""
    in_string = escaped = False
    for ch in text:
        if escaped:
            escaped = False
        elif in_string and ch == "\\":
            escaped = True
        elif ch == '"':
            in_string = not in_string
    return in_string


class HermesToolCallParser:
    def __init__(self, names: Iterable[str] | None = None, new_id: Callable[[], str] = new_call_id):
        """`names`: the tools' names (a call of another name stays content); None: any name."""
        self.names = set(names) if names is not None else None
        self.new_id = new_id
        self.calls = 0
        self._pending = ""       # text not yet judged: a possible tag start, or an open call's body
        self._scanned = 0        # how much of an open call's body has been searched for its closing tag
        self._in_call = False
        self._space = ""         # whitespace withheld: content if text follows, call syntax if a call does
        self._call_space = ""    # the whitespace that preceded the open call (content again if it fails)
        self._after_call = False  # whitespace right after a call is its syntax too

    def feed(self, text: str) -> list[Delta]:
        out: list[Delta] = []
        self._pending += text
        while True:
            if not self._in_call:
                at = self._pending.find(TOOL_CALL_OPEN)
                if at < 0:
                    keep = len(self._pending) - _partial_tag(self._pending, TOOL_CALL_OPEN)
                    self._content(self._pending[:keep], out)
                    self._pending = self._pending[keep:]
                    return out
                self._content(self._pending[:at], out)
                self._pending = self._pending[at + len(TOOL_CALL_OPEN):]
                self._in_call, self._scanned = True, 0
                self._call_space, self._space = self._space, ""
            else:
                at = self._pending.find(TOOL_CALL_CLOSE, max(0, self._scanned - len(TOOL_CALL_CLOSE) + 1))
                while at >= 0 and _inside_string(self._pending[:at]):
                    at = self._pending.find(TOOL_CALL_CLOSE, at + 1)
                if at < 0:
                    self._scanned = len(self._pending)
                    return out
                body = self._pending[:at]
                self._pending = self._pending[at + len(TOOL_CALL_CLOSE):]
                self._in_call = False
                self._close(body, out)

    def finish(self) -> list[Delta]:
        out: list[Delta] = []
        if self._in_call:  # never closed (max_tokens, say): what it wrote is content
            self._in_call = False
            self._content(self._call_space + TOOL_CALL_OPEN + self._pending, out)
        else:
            self._content(self._pending, out)
        self._pending = ""
        if not self.calls and self._space:
            out.append(ContentDelta(self._space))
        self._space = ""
        return out

    def _content(self, text: str, out: list[Delta]) -> None:
        body = text.rstrip(_WHITESPACE)
        if not body:
            self._space += text
            return
        lead = "" if self._after_call else self._space
        if self._after_call:
            body = body.lstrip(_WHITESPACE)
        out.append(ContentDelta(lead + body))
        self._space = text[len(text.rstrip(_WHITESPACE)):]
        self._after_call = False

    def _close(self, body: str, out: list[Delta]) -> None:
        call = self._read_call(body)
        if call is None:
            self._content(self._call_space + TOOL_CALL_OPEN + body + TOOL_CALL_CLOSE, out)
            return
        name, arguments = call
        out.append(ToolCallDelta(self.calls, "", self.new_id(), name))
        if arguments:
            out.append(ToolCallDelta(self.calls, arguments))
        self.calls += 1
        self._after_call, self._call_space = True, ""

    def _read_call(self, body: str) -> tuple[str, str] | None:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        name = value["name"]
        if not name or (self.names is not None and name not in self.names):
            return None
        arguments = value.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as JSON text, as OpenAI sends them
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        return name, json.dumps(arguments, ensure_ascii=False)


@dataclass
class _Item:
    """The array's item being read."""

    key: str | None = None
    name: str | None = None
    started: bool = False
    held: str = ""  # arguments read before the name (sent once the call can start)


@dataclass
class _Value:
    """A JSON value being scanned: its depth of brackets and whether inside a string."""

    raw: list[str] = field(default_factory=list)
    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def take(self, ch: str) -> bool:
        """Add `ch` if it belongs to the value; False: the value ended before it."""
        if self.in_string:
            self.raw.append(ch)
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
            return True
        if self.raw and self.depth == 0 and (self.raw[0] in '"[{' or ch in ",}]" + _WHITESPACE):
            return False  # a string or container closed, or a number or literal met its delimiter
        if ch in "[{":
            self.depth += 1
        elif ch in "]}":
            self.depth -= 1
        elif ch == '"':
            self.in_string = True
        self.raw.append(ch)
        return True

    def complete(self) -> bool:
        return bool(self.raw) and not self.in_string and self.depth == 0 and (
            self.raw[0] not in '"[{' or len(self.raw) > 1)


class JsonToolCallParser:
    def __init__(self, new_id: Callable[[], str] = new_call_id):
        self.new_id = new_id
        self.calls = 0
        self._state = "start"  # start, array, item, key, colon, value, done, content
        self._item = _Item()
        self._value: _Value | None = None

    def feed(self, text: str) -> list[Delta]:
        out: list[Delta] = []
        for i, ch in enumerate(text):
            if self._state == "content":
                out.append(ContentDelta(text[i:]))
                break
            self._step(ch, out)
        return out

    def finish(self) -> list[Delta]:
        """A truncated call keeps what it streamed (finish_reason "length" says so)."""
        out: list[Delta] = []
        if self._state == "value" and self._item.key == "name":
            self._end_value(out)
        return out

    def _step(self, ch: str, out: list[Delta]) -> None:
        state = self._state
        if state == "value":
            assert self._value is not None
            if not self._value.raw and ch in _WHITESPACE:
                return
            if self._value.take(ch):
                if self._item.key == "arguments":
                    self._arguments(ch, out)
                return
            self._end_value(out)
            state = self._state
        if ch in _WHITESPACE or (ch == "," and state in ("array", "item")):
            return
        if state == "start" and ch == "[":
            self._state = "array"
        elif state == "array" and ch == "{":
            self._state, self._item = "item", _Item()
        elif state == "array" and ch == "]":
            self._state = "done"
        elif state == "item" and ch == '"':
            self._state, self._value = "key", _Value()
            self._value.take(ch)
        elif state == "item" and ch == "}":
            self._start_call(out)
            if self._item.started:
                self.calls += 1
            self._state = "array"
        elif state == "colon" and ch == ":":
            self._state, self._value = "value", _Value()
        elif state == "key":
            self._key(ch)
        else:  # outside the enforced shape (no grammar held it to it): the rest is content
            self._state = "content"
            out.append(ContentDelta(ch))

    def _key(self, ch: str) -> None:
        assert self._value is not None
        self._value.take(ch)
        if self._value.complete():
            self._item.key = json.loads("".join(self._value.raw))
            self._state = "colon"

    def _end_value(self, out: list[Delta]) -> None:
        assert self._value is not None
        if self._item.key == "name" and self._value.complete():
            try:
                name = json.loads("".join(self._value.raw))
            except ValueError:  # outside the enforced shape
                name = "".join(self._value.raw)
            self._item.name = name if isinstance(name, str) else json.dumps(name)
            self._start_call(out)
        self._state, self._value = "item", None

    def _arguments(self, ch: str, out: list[Delta]) -> None:
        if self._item.started:
            out.append(ToolCallDelta(self.calls, ch))
        else:
            self._item.held += ch

    def _start_call(self, out: list[Delta]) -> None:
        item = self._item
        if item.started or (item.name is None and not item.held):
            return
        out.append(ToolCallDelta(self.calls, "", self.new_id(), item.name or ""))
        item.started = True
        if item.held:
            out.append(ToolCallDelta(self.calls, item.held))
            item.held = ""


def make_parser(plan: ToolPlan | None) -> ToolCallParser | None:
    """The parser a chat request's outputs go through; None: plain content."""
    if plan is None or not plan.parses_calls:
        return None
    if plan.forced:
        return JsonToolCallParser()
    return HermesToolCallParser(t["function"]["name"] for t in plan.tools)


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
