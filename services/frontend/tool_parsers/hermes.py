"""`hermes` (Qwen2.5, Qwen3, Hermes and vmesh's built-in prompt):
<tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks anywhere in the text. A call is
emitted once its block has closed and its JSON reads as a call of a known tool: a block that does
not (malformed JSON, an unknown name, no closing tag by the end) stays content, as written, tags
included. Whitespace around calls is part of their syntax, not content."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable

from vmesh.services.common.tool_prompt import HERMES_PROMPT, TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from vmesh.services.frontend.tool_parsers.base import CallParser, Delta, new_call_id, partial_tag, read_call
from vmesh.services.frontend.tool_parsers.format import ToolFormat


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


class HermesToolCallParser(CallParser):
    def __init__(self, names: Iterable[str] | None = None, new_id: Callable[[], str] = new_call_id):
        super().__init__(names, new_id)
        self._pending = ""       # text not yet judged: a possible tag start, or an open call's body
        self._scanned = 0        # how much of an open call's body has been searched for its closing tag
        self._in_call = False
        self._call_space = ""    # the whitespace that preceded the open call (content again if it fails)

    def feed(self, text: str) -> list[Delta]:
        out: list[Delta] = []
        self._pending += text
        while True:
            if not self._in_call:
                at = self._pending.find(TOOL_CALL_OPEN)
                if at < 0:
                    keep = len(self._pending) - partial_tag(self._pending, TOOL_CALL_OPEN)
                    self.content.write(self._pending[:keep], out)
                    self._pending = self._pending[keep:]
                    return out
                self.content.write(self._pending[:at], out)
                self._pending = self._pending[at + len(TOOL_CALL_OPEN):]
                self._in_call, self._scanned = True, 0
                self._call_space = self.content.take_space()
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
            self.content.write(self._call_space + TOOL_CALL_OPEN + self._pending, out)
        else:
            self.content.write(self._pending, out)
        self._pending = ""
        self.content.finish(self.calls > 0, out)
        return out

    def _close(self, body: str, out: list[Delta]) -> None:
        try:
            call = read_call(json.loads(body), self.names)
        except ValueError:
            call = None
        if call is None:
            self.content.write(self._call_space + TOOL_CALL_OPEN + body + TOOL_CALL_CLOSE, out)
            return
        self.emit(*call, out)
        self._call_space = ""


FORMAT = ToolFormat("hermes", HermesToolCallParser, HERMES_PROMPT, markers=(TOOL_CALL_OPEN, TOOL_CALL_CLOSE),
                    template_hints=(TOOL_CALL_OPEN,))
