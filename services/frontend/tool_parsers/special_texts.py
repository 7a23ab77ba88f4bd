"""Special tokens' texts taken out of a parser's input. A format whose marker is a special token
(Mistral's [TOOL_CALLS], Llama's <|python_tag|>) needs it decoded, so its requests are decoded
with special tokens kept; this filter then removes every other special token's text (an EOS that
ended the answer, say) before the parser reads it, so that the client's content is what skipping
special tokens would have given it."""

from __future__ import annotations

from collections.abc import Iterable

from vmesh.services.frontend.tool_parsers.base import Delta, ToolCallParser


class SpecialTextFilter:
    def __init__(self, parser: ToolCallParser, dropped: Iterable[str]):
        self.parser = parser
        self._dropped = sorted({t for t in dropped if t}, key=len, reverse=True)  # the longest match first
        self._firsts = {t[0] for t in self._dropped}
        self._prefixes = {t[:n] for t in self._dropped for n in range(1, len(t))}
        self._longest = max(map(len, self._dropped), default=0)
        self._pending = ""

    @property
    def calls(self) -> int:
        return self.parser.calls

    def feed(self, text: str) -> list[Delta]:
        self._pending += text
        return self.parser.feed(self._take(final=False))

    def finish(self) -> list[Delta]:
        return [*self.parser.feed(self._take(final=True)), *self.parser.finish()]

    def _take(self, final: bool) -> str:
        """The pending text without special tokens' texts, up to where one may be starting."""
        p, kept, i = self._pending, [], 0
        while i < len(p):
            if p[i] not in self._firsts:
                i += 1
                continue
            if not final and len(p) - i < self._longest and p[i:] in self._prefixes:
                break  # a special token's text may be arriving: wait for the rest
            match = next((t for t in self._dropped if p.startswith(t, i)), None)
            if match is None:
                i += 1
                continue
            kept.append(p[:i])
            p, i = p[i + len(match):], 0
        else:
            self._pending = ""
            return "".join(kept) + p
        self._pending = p[i:]
        return "".join(kept) + p[:i]
