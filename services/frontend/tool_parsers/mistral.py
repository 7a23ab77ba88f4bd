"""`mistral` (Mistral 7B Instruct v0.3, Mixtral 8x22B Instruct, Mistral Small and Nemo): the
special token [TOOL_CALLS], then the calls, in either of the two forms Mistral's tokenizers write:
a JSON array `[{"name": ..., "arguments": {...}}, ...]` (a single object is read as one call), or
(tokenizer v11 and later) `name[ARGS]{...}`, the marker repeated before each call.

The calls after a marker are emitted once their JSON has closed and reads as calls of known tools.
The marker never reaches content (a client that skips special tokens would not see it); when what
follows it is not calls (malformed JSON, an unknown name, cut off by the end), that text is read
again as text: content, as written, unless it holds another marker. Call ids are nine letters and
digits, the only ids Mistral's chat templates accept when the calls come back in the history."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Sequence

from vmesh.services.common.tool_prompt import Call, ToolPrompt
from vmesh.services.frontend.tool_parsers.base import (
    WHITESPACE,
    Balanced,
    Delta,
    MarkedCallParser,
    new_short_call_id,
    partial_tag,
    read_call,
)
from vmesh.services.frontend.tool_parsers.format import ToolFormat

MARKER = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
_NAME_SO_FAR = re.compile(r"[A-Za-z0-9_-]{0,64}")


class MistralToolCallParser(MarkedCallParser):
    def __init__(self, names: Iterable[str] | None = None, new_id: Callable[[], str] = new_short_call_id):
        super().__init__(MARKER, "text", names, new_id)  # states: text, open (after the marker or [ARGS]), name, body
        self._name: str | None = None  # the v11 form's name, read before its [ARGS]

    def _steps(self) -> dict[str, Callable[[list[Delta], bool], bool]]:
        return {"text": self._text, "open": self._open, "name": self._read_name, "body": self._body}

    def _open(self, out: list[Delta], final: bool) -> bool:
        p = self._pending
        stripped = p.lstrip(WHITESPACE)
        self._raw += p[:len(p) - len(stripped)]
        self._pending = stripped
        if not stripped:
            return self._fail(out) if final else False
        if stripped[0] == "{" or (stripped[0] == "[" and self._name is None):
            self._state, self._value = "body", Balanced()
        elif self._name is None:
            self._state = "name"
        else:  # [ARGS] not followed by an object
            return self._fail(out)
        return True

    def _read_name(self, out: list[Delta], final: bool) -> bool:
        p = self._pending
        at = p.find(ARGS)
        if at >= 0 and _NAME.fullmatch(p[:at]):
            self._name, self._raw = p[:at], self._raw + p[:at + len(ARGS)]
            self._pending, self._state = p[at + len(ARGS):], "open"
            return True
        head = p[:len(p) - partial_tag(p, ARGS)] if at < 0 else p
        if final or at >= 0 or not _NAME_SO_FAR.fullmatch(head):
            return self._fail(out)  # no name, or not one: the rest is read as text
        return False

    def _body(self, out: list[Delta], final: bool) -> bool:
        end = self._value.end(self._pending)
        if end is None:
            return self._fail(out) if final else False
        body, self._pending = self._pending[:end], self._pending[end:]
        calls = self._read(body)
        if calls is None:
            self._pending = body + self._pending
            return self._fail(out)
        for name, arguments in calls:
            self.emit(name, arguments, out)
        self._state, self._name = "text", None
        return True

    def _read(self, body: str) -> list[tuple[str, str]] | None:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if self._name is not None:
            value = {"name": self._name, "arguments": value} if isinstance(value, dict) else None
        items = value if isinstance(value, list) else [value]
        calls = [read_call(item, self.names) for item in items]
        if not calls or any(c is None for c in calls):
            return None
        return [c for c in calls if c is not None]

    def _fail(self, out: list[Delta]) -> bool:
        """No calls after the marker: what followed it is read again as text, the marker is dropped."""
        self.content.write(self._space, out)
        self._pending = self._raw + self._pending
        self._space, self._raw, self._name, self._state = "", "", None, "text"
        return True


def _write_calls(calls: Sequence[Call]) -> str:
    return MARKER + json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)


PROMPT = ToolPrompt(
    'To call functions, answer with [TOOL_CALLS] followed by a JSON array of the calls, each '
    '{"name": "<function name>", "arguments": {<arguments as a JSON object>}}:\n'
    '[TOOL_CALLS][{"name": "<function name>", "arguments": {<arguments as a JSON object>}}]', _write_calls)
FORMAT = ToolFormat("mistral", MistralToolCallParser, PROMPT, markers=(MARKER, ARGS), template_hints=(MARKER,))
