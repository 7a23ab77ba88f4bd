"""`llama3_json` (Llama 3.1, 3.2 and 3.3 with their JSON tool calling): a call is a JSON object
`{"name": ..., "parameters": {...}}` ("arguments" is read too), written either as the whole
answer (its first character, whitespace aside, is the object's brace) or after the special token
<|python_tag|>. Several calls follow one another, separated by whitespace or ";".

A call is emitted once its object has closed and reads as a call of a known tool; an object that
does not is read again as text, and text is content, as written. <|python_tag|> never reaches content (a
client that skips special tokens would not see it); the separators between calls do not either."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence

from vmesh.services.common.tool_prompt import Call, ToolPrompt
from vmesh.services.frontend.tool_parsers.base import (
    WHITESPACE,
    Balanced,
    Delta,
    MarkedCallParser,
    new_call_id,
    read_call,
)
from vmesh.services.frontend.tool_parsers.format import ToolFormat

PYTHON_TAG = "<|python_tag|>"
ARGUMENT_KEYS = ("parameters", "arguments")


class Llama3JsonToolCallParser(MarkedCallParser):
    def __init__(self, names: Iterable[str] | None = None, new_id: Callable[[], str] = new_call_id):
        # States: start (the answer's first character), text, open (after the tag), body, between.
        super().__init__(PYTHON_TAG, "start", names, new_id)

    def _steps(self) -> dict[str, Callable[[list[Delta], bool], bool]]:
        return {"start": self._start, "text": self._text, "open": self._open, "body": self._body,
                "between": self._between}

    def _start(self, out: list[Delta], final: bool) -> bool:
        p = self._pending
        stripped = p.lstrip(WHITESPACE)
        if not stripped and not final:
            return False
        if stripped.startswith("{"):
            self._raw, self._pending = p[:len(p) - len(stripped)], stripped
            self._state, self._value = "body", Balanced()
        else:
            self._state = "text"
        return True

    def _open(self, out: list[Delta], final: bool) -> bool:
        p = self._pending
        stripped = p.lstrip(WHITESPACE)
        if not stripped and not final:
            return False
        self._raw += p[:len(p) - len(stripped)]
        self._pending = stripped
        if stripped.startswith("{"):
            self._state, self._value = "body", Balanced()
            return True
        return self._fail(out)  # not JSON after the tag (Llama's built-in tools write Python there)

    def _body(self, out: list[Delta], final: bool) -> bool:
        end = self._value.end(self._pending)
        if end is None:
            return self._fail(out) if final else False
        body, self._pending = self._pending[:end], self._pending[end:]
        try:
            call = read_call(json.loads(body), self.names, ARGUMENT_KEYS)
        except ValueError:
            call = None
        if call is None:
            self._pending = body + self._pending
            return self._fail(out)
        self.emit(*call, out)
        self._space, self._raw, self._state = "", "", "between"
        return True

    def _between(self, out: list[Delta], final: bool) -> bool:
        """After a call: another one, after whitespace and at most one ";", or text."""
        p = self._pending
        rest = p.lstrip(WHITESPACE)
        if rest.startswith(";"):
            rest = rest[1:].lstrip(WHITESPACE)
        if not rest and not final:
            return False
        if rest.startswith("{"):
            self._raw, self._pending = p[:len(p) - len(rest)], rest
            self._state, self._value = "body", Balanced()
        else:
            self._state = "text"
        return True

    def _fail(self, out: list[Delta]) -> bool:
        """Not a call: what was read as one is read again as text (the tag dropped)."""
        self.content.write(self._space, out)
        self._pending = self._raw + self._pending
        self._space, self._raw, self._state = "", "", "text"
        return True


def _write_calls(calls: Sequence[Call]) -> str:
    return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)


PROMPT = ToolPrompt(
    'To call a function, answer with only a JSON object {"name": "<function name>", "parameters": '
    '{<arguments as a JSON object>}}; to call several, write their objects one after another, separated by "; ".',
    _write_calls)
FORMAT = ToolFormat("llama3_json", Llama3JsonToolCallParser, PROMPT, markers=(PYTHON_TAG,),
                    template_hints=(PYTHON_TAG, '"parameters": dictionary of argument name'))
