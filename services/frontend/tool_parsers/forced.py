"""The parser of "required" / a named function: the JSON array tool_calls.tool_choice_schema
enforces, `[{"name": ..., "arguments": {...}}, ...]`, whatever the served format. The grammar
guarantees every prefix is valid, so each call's arguments stream as the model writes them."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from vmesh.services.frontend.tool_parsers.base import WHITESPACE, ContentDelta, Delta, ToolCallDelta, new_call_id


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
        if self.raw and self.depth == 0 and (self.raw[0] in '"[{' or ch in ",}]" + WHITESPACE):
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
            if not self._value.raw and ch in WHITESPACE:
                return
            if self._value.take(ch):
                if self._item.key == "arguments":
                    self._arguments(ch, out)
                return
            self._end_value(out)
            state = self._state
        if ch in WHITESPACE or (ch == "," and state in ("array", "item")):
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
