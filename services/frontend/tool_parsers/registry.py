"""Which tool-call format the served model writes, chosen once as the frontend starts
(`--tool-call-parser`, vLLM's names, or `auto`), and how each chat request's output is read with it.

`auto` reads the model's own signals, most explicit first: the format its chat template writes
when the template renders the tools itself; else a format's special token in its vocabulary;
else its family (Gemma: `pythonic`, the form Google's function-calling guide for Gemma asks for);
else `hermes`, vmesh's built-in prompt. Where the template does not render tools, vmesh's built-in
prompt asks for the chosen format (services/common/tool_prompt.py), so what the model is asked to
write and what is parsed are one format."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from vmesh.services.common.tokenizer import template_supports_tools
from vmesh.services.common.types import SamplingParams
from vmesh.services.frontend.settings import TOOL_CALL_PARSERS
from vmesh.services.frontend.tool_calls import ToolPlan
from vmesh.services.frontend.tool_parsers import hermes, llama3_json, mistral, pythonic
from vmesh.services.frontend.tool_parsers.base import FirstCallOnly, ToolCallParser
from vmesh.services.frontend.tool_parsers.forced import JsonToolCallParser
from vmesh.services.frontend.tool_parsers.format import ToolFormat
from vmesh.services.frontend.tool_parsers.special_texts import SpecialTextFilter

# In the order `auto` tries their signals (Hermes' tags last: other formats' templates may mention them).
FORMATS: dict[str, ToolFormat] = {f.name: f for f in (mistral.FORMAT, llama3_json.FORMAT, pythonic.FORMAT,
                                                      hermes.FORMAT)}
AUTO = "auto"  # the flag's other value (settings.TOOL_CALL_PARSERS: AUTO and these formats' names)
GEMMA_TURN = "<start_of_turn>"


@dataclass(frozen=True)
class ToolReader:
    """How one request's output is read back into calls: its plan, the served format, and the
    special tokens' texts taken out first (decoded only because the format's marker needs them)."""

    plan: ToolPlan
    format: ToolFormat = hermes.FORMAT
    dropped: tuple[str, ...] = ()

    def parser(self) -> ToolCallParser:
        if self.plan.forced:
            return JsonToolCallParser()
        parser = self.format.parser(t["function"]["name"] for t in self.plan.tools)
        if self.dropped:
            parser = SpecialTextFilter(parser, self.dropped)
        return parser if self.plan.parallel else FirstCallOnly(parser)


@dataclass(frozen=True)
class ServedToolFormat:
    format: ToolFormat
    reason: str  # why this one (logged as the frontend starts)
    special_texts: tuple[str, ...] = ()  # every special token's text in the vocabulary
    hidden_markers: tuple[str, ...] = ()  # the format's markers that decoding skips unless told not to

    def reader(self, plan: ToolPlan | None, sampling: SamplingParams) -> tuple[ToolReader | None, SamplingParams]:
        """The reader of a request's output, and its sampling: where the format's marker is a
        special token and the client skips special tokens (the default), decoding keeps them and
        the reader takes out all but the markers, so that the parser sees its marker and the
        client's content is what it would have been."""
        if plan is None or not plan.parses_calls:
            return None, sampling
        if plan.forced or not self.hidden_markers or not sampling.skip_special_tokens:
            return ToolReader(plan, self.format), sampling
        dropped = tuple(t for t in self.special_texts if t not in self.format.markers)
        return ToolReader(plan, self.format, dropped), replace(sampling, skip_special_tokens=False)

    def describe(self) -> str:
        kept = f"; tool requests decode special tokens to see {', '.join(self.hidden_markers)}" \
            if self.hidden_markers else ""
        return f"tool-call parser {self.format.name} ({self.reason}){kept}"


def added_tokens(tokenizer: Any) -> dict[str, bool]:
    """Each added token's text -> whether it is special (decoding skips it by default)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None)
    if not isinstance(decoder, dict):
        return {}
    return {t.content: bool(getattr(t, "special", False)) for t in decoder.values() if getattr(t, "content", "")}


def _first(formats: Iterable[ToolFormat], found: Any) -> ToolFormat | None:
    return next((f for f in formats if found(f)), None)


def automatic(template: str, vocabulary: dict[str, bool], model_type: str = "") -> tuple[ToolFormat, str]:
    """`auto`'s choice from the chat template, the added tokens and the model type (config.json)."""
    if template_supports_tools(template):
        written = _first(FORMATS.values(), lambda f: any(h in template for h in f.template_hints))
        if written is not None:
            return written, "the chat template writes it"
    held = _first(FORMATS.values(), lambda f: bool(f.markers) and f.markers[0] in vocabulary)
    if held is not None:
        return held, f"the vocabulary has {held.markers[0]}"
    if model_type.startswith("gemma") or GEMMA_TURN in template or GEMMA_TURN in vocabulary:
        return pythonic.FORMAT, "Gemma: Google's function-calling guide asks for Python-style calls"
    return hermes.FORMAT, "vmesh's default: its built-in prompt asks for Hermes-style calls"


def choose_tool_format(requested: str, tokenizer: Any, model_type: str = "") -> ServedToolFormat:
    """The served format: `requested` (a name of TOOL_CALL_PARSERS), `auto` choosing from the tokenizer."""
    vocabulary = added_tokens(tokenizer)
    if requested == AUTO:
        chosen, reason = automatic(getattr(tokenizer, "chat_template", None) or "", vocabulary, model_type)
    elif requested in FORMATS:
        chosen, reason = FORMATS[requested], "--tool-call-parser"
    else:
        raise ValueError(f"--tool-call-parser: {requested!r} is not one of {', '.join(TOOL_CALL_PARSERS)}")
    return ServedToolFormat(chosen, reason, tuple(t for t, special in vocabulary.items() if special),
                            tuple(m for m in chosen.markers if vocabulary.get(m)))
