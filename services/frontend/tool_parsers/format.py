"""One tool-call format as vmesh serves it: its name (vLLM's `--tool-call-parser` name), the
parser that reads it, how the built-in prompt asks a model for it, and the texts that give it away
in a chat template or a vocabulary. Adding a format is one module of services/frontend/tool_parsers
that defines its parser and FORMAT, listed in registry.FORMATS, plus its tests."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from vmesh.services.common.tool_prompt import ToolPrompt
from vmesh.services.frontend.tool_parsers.base import ToolCallParser


@dataclass(frozen=True)
class ToolFormat:
    name: str
    parser: Callable[[Iterable[str] | None], ToolCallParser]  # the tools' names -> a parser of one choice
    # What the built-in prompt shows a model whose chat template cannot show tools.
    prompt: ToolPrompt
    # The texts of the format's own tokens, which the parser must see: where the vocabulary holds
    # one as a special token, decoding would skip it unless told otherwise (registry.ServedToolFormat).
    markers: tuple[str, ...] = ()
    # Text that a chat template writing this format contains (the template renders the tools itself).
    template_hints: tuple[str, ...] = ()
