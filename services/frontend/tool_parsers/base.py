"""What every tool-call parser shares: the deltas it answers, its interface, and the pieces each
format's parser is built from (content written around calls, a call checked against the tools,
the end of a bracketed value found as its text arrives).

A parser is fed the text deltas of one choice and answers content deltas and tool-call deltas (a
call's first delta has its index, id and name; a later one a fragment of its arguments). Its
decisions depend only on the text seen so far, and it waits rather than guess where the text
could still go either way, so that however the text is split the deltas add up to one message:
the non-streamed response is the same parser fed the whole text."""

from __future__ import annotations

import json
import secrets
import string
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

WHITESPACE = " \t\r\n"
_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def new_short_call_id() -> str:
    """Nine letters and digits: Mistral's chat templates refuse any other tool call id in the history."""
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))


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
    @property
    def calls(self) -> int:
        """How many calls it has emitted."""

    def feed(self, text: str) -> list[Delta]: ...

    def finish(self) -> list[Delta]: ...


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that begins `tag` (a tag split across deltas)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def read_call(value: Any, names: set[str] | None, argument_keys: tuple[str, ...] = ("arguments",)
              ) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a decoded call {"name": ..., <argument key>: {...}}, or
    None where it is not one: not an object, no name, a name not among `names` (None: any), or
    arguments that are not an object (JSON text holding an object counts: some models write the
    arguments as OpenAI sends them)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    name = value["name"]
    if not name or (names is not None and name not in names):
        return None
    arguments: Any = next((value[k] for k in argument_keys if k in value), {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return name, json.dumps(arguments, ensure_ascii=False)


class ContentWriter:
    """Content around calls. Whitespace next to a call is the call's syntax, not content: trailing
    whitespace is withheld until text follows it (or the output ends without calls), and
    whitespace right after a call is dropped."""

    def __init__(self) -> None:
        self.space = ""  # withheld: content if text follows, call syntax if a call does
        self.after_call = False

    def write(self, text: str, out: list[Delta]) -> None:
        body = text.rstrip(WHITESPACE)
        if not body:
            self.space += text
            return
        lead = "" if self.after_call else self.space
        if self.after_call:
            body = body.lstrip(WHITESPACE)
        out.append(ContentDelta(lead + body))
        self.space = text[len(text.rstrip(WHITESPACE)):]
        self.after_call = False

    def take_space(self) -> str:
        """The withheld whitespace, handed to a call that may open (given back if it fails)."""
        space, self.space = self.space, ""
        return space

    def finish(self, made_calls: bool, out: list[Delta]) -> None:
        if not made_calls and self.space:
            out.append(ContentDelta(self.space))
        self.space = ""


class CallParser:
    """The state every format's parser keeps: the tools' names, ids, calls made, content written."""

    def __init__(self, names: Iterable[str] | None = None, new_id: Callable[[], str] = new_call_id):
        """`names`: the tools' names (a call of another name stays content); None: any name."""
        self.names = set(names) if names is not None else None
        self.new_id = new_id
        self.calls = 0
        self.content = ContentWriter()

    def emit(self, name: str, arguments: str, out: list[Delta]) -> None:
        out.append(ToolCallDelta(self.calls, "", self.new_id(), name))
        if arguments:
            out.append(ToolCallDelta(self.calls, arguments))
        self.calls += 1
        self.content.after_call = True


class Balanced:
    """Where a bracketed value ends, its text fed as it arrives: brackets are counted outside
    strings (`quotes`: the characters that open and close one; a backslash escapes inside)."""

    def __init__(self, quotes: str = '"'):
        self.quotes = quotes
        self.depth = 0
        self.quote: str | None = None
        self.escaped = False
        self.seen = 0  # characters of the value already scanned

    def end(self, text: str) -> int | None:
        """`text`: the value so far, from its opening bracket (the same text, longer at each
        call). The length of the value once its bracket has closed, else None."""
        for i in range(self.seen, len(text)):
            ch = text[i]
            if self.quote is not None:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == self.quote:
                    self.quote = None
            elif ch in self.quotes:
                self.quote = ch
            elif ch in "[{(":
                self.depth += 1
            elif ch in "]})":
                self.depth -= 1
                if self.depth <= 0:
                    self.seen = i + 1
                    return i + 1
        self.seen = len(text)
        return None


class MarkedCallParser(CallParser):
    """A format whose calls follow a marker in the text ([TOOL_CALLS], <|python_tag|>): the text
    held until it is judged, the state it is judged in, and the marker's search. A subclass
    names its states' steps (`_steps`) and its first state."""

    def __init__(self, marker: str, first_state: str, names: Iterable[str] | None = None,
                 new_id: Callable[[], str] = new_call_id):
        super().__init__(names, new_id)
        self.marker = marker
        self._pending = ""  # text not yet judged
        self._state = first_state
        self._space = ""  # the whitespace before a call (content again if no call follows)
        self._raw = ""  # what followed the marker so far (read again as text if no call follows)
        self._value = Balanced()

    def _steps(self) -> dict[str, Callable[[list[Delta], bool], bool]]:
        raise NotImplementedError

    def feed(self, text: str) -> list[Delta]:
        self._pending += text
        return self._run(final=False)

    def finish(self) -> list[Delta]:
        out = self._run(final=True)
        self.content.finish(self.calls > 0, out)
        return out

    def _run(self, final: bool) -> list[Delta]:
        out: list[Delta] = []
        steps = self._steps()
        while steps[self._state](out, final):
            pass
        return out

    def _text(self, out: list[Delta], final: bool) -> bool:
        """Content up to the marker (a marker's start at the end is held); then the call opens."""
        p = self._pending
        at = p.find(self.marker)
        if at < 0:
            keep = len(p) if final else len(p) - partial_tag(p, self.marker)
            self.content.write(p[:keep], out)
            self._pending = p[keep:]
            return False
        self.content.write(p[:at], out)
        self._pending = p[at + len(self.marker):]
        self._space, self._raw, self._state = self.content.take_space(), "", "open"
        return True


class FirstCallOnly:
    """`parallel_tool_calls: false` where no grammar holds the output to one call ("auto"): the
    model's text may hold several whatever the prompt asked, and the first is the answer; later
    calls' deltas are dropped, content around them kept."""

    def __init__(self, parser: ToolCallParser):
        self.parser = parser

    @property
    def calls(self) -> int:
        return min(self.parser.calls, 1)

    def feed(self, text: str) -> list[Delta]:
        return self._first(self.parser.feed(text))

    def finish(self) -> list[Delta]:
        return self._first(self.parser.finish())

    @staticmethod
    def _first(deltas: list[Delta]) -> list[Delta]:
        return [d for d in deltas if not (isinstance(d, ToolCallDelta) and d.index > 0)]
