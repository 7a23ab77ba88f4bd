"""`pythonic` (Llama 3.2 and 4's Python-style calling, and Gemma 3: Google's function-calling
guide for Gemma asks for this form, since Gemma has no tool tokens): a Python list of calls with
keyword arguments, `[get_weather(city="Oslo", days=3), get_time(tz='UTC')]`, opening at the start
of the answer or of a line. Argument values are Python literals (strings, numbers, True/False/
None, lists, dicts); JSON's true/false/null are read too.

The list's calls are emitted once its bracket has closed and every item reads as a call of a known
tool; a list that does not (a plain list, a call with positional arguments, an expression, no
closing bracket by the end) stays content, as written."""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from vmesh.services.common.tool_prompt import Call, ToolPrompt
from vmesh.services.frontend.tool_parsers.base import Balanced, CallParser, Delta, new_call_id
from vmesh.services.frontend.tool_parsers.format import ToolFormat

_JSON_NAMES = {"true": True, "false": False, "null": None}
_INDENT = " \t"
# A list of calls begins `[name(`: a list that cannot (a markdown link, say) is content at once,
# rather than held until its bracket closes.
_CALL_START = re.compile(r"\[\s*(?:([A-Za-z_]\w*)\s*(\()?)?")


def _literal(node: ast.expr) -> Any:
    """A JSON value from a Python literal's syntax tree (ValueError for anything else)."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, bool, int, float))):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise ValueError("not a JSON number")
        return node.value
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError("a sign before a non-number")
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        keys = [_literal(k) if k is not None else None for k in node.keys]
        if not all(isinstance(k, str) for k in keys):
            raise ValueError("a dict key that is not a string")
        return dict(zip(keys, (_literal(v) for v in node.values)))
    raise ValueError(f"not a literal: {type(node).__name__}")


def read_calls(text: str, names: set[str] | None) -> list[tuple[str, str]] | None:
    """[(name, arguments as JSON text)] of a Python list of calls, or None where it is not one."""
    try:
        node = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(node, ast.List) or not node.elts:
        return None
    calls = []
    for item in node.elts:
        if not (isinstance(item, ast.Call) and isinstance(item.func, ast.Name) and not item.args):
            return None
        name = item.func.id
        if names is not None and name not in names:
            return None
        try:
            arguments = {k.arg: _literal(k.value) for k in item.keywords if k.arg is not None}
        except (ValueError, RecursionError):
            return None
        if len(arguments) != len(item.keywords):  # **kwargs
            return None
        calls.append((name, json.dumps(arguments, ensure_ascii=False)))
    return calls


class PythonicToolCallParser(CallParser):
    def __init__(self, names: Iterable[str] | None = None, new_id: Callable[[], str] = new_call_id):
        super().__init__(names, new_id)
        self._pending = ""  # an open list's text
        self._in_list = False
        self._began = False  # the open list begins `[name(`
        self._line_start = True  # the text so far ends at the start of a line (indentation aside)
        self._space = ""  # the whitespace before the list (content again if it is not calls)
        self._value = Balanced("\"'")

    def feed(self, text: str) -> list[Delta]:
        out: list[Delta] = []
        self._pending += text
        while self._pending and self._step(out, final=False):
            pass
        return out

    def finish(self) -> list[Delta]:
        out: list[Delta] = []
        while self._pending and self._step(out, final=True):
            pass
        self.content.finish(self.calls > 0, out)
        return out

    def _step(self, out: list[Delta], final: bool) -> bool:
        if self._in_list:
            return self._list(out, final)
        at = self._opening(self._pending)
        text = self._pending if at < 0 else self._pending[:at]
        self._write(text, out)
        if at < 0:
            self._pending = ""
            return False
        self._pending, self._in_list, self._began = self._pending[at:], True, False
        self._space, self._value = self.content.take_space(), Balanced("\"'")
        return True

    def _opening(self, text: str) -> int:
        """Where a list opens at the start of a line in `text`; -1: nowhere."""
        at = 0
        line_start = self._line_start
        while True:
            if line_start:
                rest = text[at:]
                first = at + len(rest) - len(rest.lstrip(_INDENT))
                if first < len(text) and text[first] == "[":
                    return first
            newline = text.find("\n", at)
            if newline < 0:
                return -1
            at, line_start = newline + 1, True

    def _write(self, text: str, out: list[Delta]) -> None:
        if "\n" in text:
            self._line_start = not text[text.rindex("\n") + 1:].strip(_INDENT)
        elif text.strip(_INDENT):
            self._line_start = False
        self.content.write(text, out)

    def _list(self, out: list[Delta], final: bool) -> bool:
        if not self._began:
            start = _CALL_START.match(self._pending)
            assert start is not None  # the list's bracket is there
            if start.group(2):
                self._began = True
            elif start.end() == len(self._pending) and not final:
                return False  # `[name` so far: it may yet be a call
            elif not final:  # not a list of calls: its bracket is content, the rest is read again
                self._in_list = False
                self._write(self._space + "[", out)
                self._pending = self._pending[1:]
                return True
        end = self._value.end(self._pending)
        if end is None and not final:
            return False
        end = len(self._pending) if end is None else end
        body, self._pending = self._pending[:end], self._pending[end:]
        self._in_list = False
        calls = read_calls(body, self.names)
        if calls is None:
            self._write(self._space + body, out)
        for name, arguments in calls or ():
            self.emit(name, arguments, out)
        self._line_start = False
        return True


def _python(value: Any) -> str:
    """A JSON value as a Python literal."""
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(map(_python, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {_python(v)}" for k, v in value.items()) + "}"
    return json.dumps(value, ensure_ascii=False)  # strings and numbers read the same in Python


def _write_calls(calls: Sequence[Call]) -> str:
    def one(name: str, arguments: Any) -> str:
        pairs = arguments.items() if isinstance(arguments, dict) else ()
        return f"{name}({', '.join(f'{k}={_python(v)}' for k, v in pairs)})"

    return "[" + ", ".join(one(n, a) for n, a in calls) + "]"


PROMPT = ToolPrompt(
    "To call functions, answer with only a Python list of the calls, with keyword arguments:\n"
    "[func_name1(param_1=value_1, param_2=value_2), func_name2(param=value)]", _write_calls)
FORMAT = ToolFormat("pythonic", PythonicToolCallParser, PROMPT, template_hints=("func_name1(",))
