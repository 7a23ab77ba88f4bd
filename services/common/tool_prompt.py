"""vmesh's built-in tool-calling prompt: the tools listed as JSON inside <tools></tools> in the
system message, the way to call them said in the served tool-call format (by default
Hermes-style, each call answered as <tool_call>{"name": ..., "arguments": {...}}</tool_call>),
each result sent back inside <tool_response></tool_response>.

A chat template that references `tools` renders them itself (transformers' convention); a
template that does not (SmolLM2's ChatML, say) would drop them silently, so the conversation is
rewritten into plain system/user/assistant messages in this format before that template renders
it. The frontend's tool-call parsers (services/frontend/tool_parsers/) read the same formats: each
format's module there gives its ToolPrompt, and the frontend hands the served one to its
tokenizer (`tool_prompt`); every other door keeps HERMES_PROMPT."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"

TOOLS_LIST = """# Tools

You can call functions to help answer the user. Their signatures, as JSON, are inside <tools></tools>:
<tools>
{tools}
</tools>

"""
RESULTS_NOTE = "\nEach call's result comes back inside <tool_response></tool_response>."
HERMES_HOW_TO_CALL = """To call a function, answer with one JSON object per call, each inside its own \
<tool_call></tool_call> tags:
<tool_call>
{"name": "<function name>", "arguments": {<arguments as a JSON object>}}
</tool_call>"""

Call = tuple[str, Any]  # a past call: its function's name and its arguments as a value


@dataclass(frozen=True)
class ToolPrompt:
    """A tool-call format as the built-in prompt shows it: how to call (after the tools' list), and
    how the assistant's past calls read in the history (in the format it is asked to write)."""

    how_to_call: str
    write_calls: Callable[[Sequence[Call]], str]


def tool_call_text(name: str, arguments: Any) -> str:
    return f"{TOOL_CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n" \
           f"{TOOL_CALL_CLOSE}"


HERMES_PROMPT = ToolPrompt(HERMES_HOW_TO_CALL, lambda calls: "\n".join(tool_call_text(n, a) for n, a in calls))


def tools_preamble(tools: Sequence[dict[str, Any]], prompt: ToolPrompt = HERMES_PROMPT) -> str:
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return TOOLS_LIST.replace("{tools}", listed) + prompt.how_to_call + RESULTS_NOTE


def _arguments(function: dict[str, Any]) -> Any:
    """A call's arguments as a value: OpenAI sends them as JSON text, templates print them as JSON."""
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as tool-aware templates take them (transformers' convention): each assistant
    call's arguments as a value rather than JSON text."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = {**message, "tool_calls": [
                {**call, "function": {**call["function"], "arguments": _arguments(call["function"])}}
                for call in calls]}
        out.append(message)
    return out


def builtin_messages(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
                     prompt: ToolPrompt = HERMES_PROMPT) -> list[dict[str, Any]]:
    """The conversation as plain system/user/assistant messages in the built-in format: the tools
    preamble appended to the system message (one is added first if there is none), assistant
    calls written in `prompt`'s format after the message's text, and consecutive tool results
    folded into one user message of <tool_response> blocks (templates that know no "tool" role
    would refuse it or render it as an unknown speaker)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "tool":
            block = f"{TOOL_RESPONSE_OPEN}\n{content}\n{TOOL_RESPONSE_CLOSE}"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        calls = [(c["function"]["name"], _arguments(c["function"])) for c in message.get("tool_calls") or ()]
        written = prompt.write_calls(calls) if calls else ""
        out.append({"role": role, "content": "\n".join(t for t in (content, written) if t)})
    for message in out:
        message.pop("_tool_results", None)
    if tools:
        preamble = tools_preamble(tools, prompt)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{preamble}" if out[0]["content"] else preamble}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out


def uses_tool_history(messages: Sequence[dict[str, Any]]) -> bool:
    return any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)


def prepare_chat(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
                 template_supports_tools: bool, prompt: ToolPrompt = HERMES_PROMPT
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) to render with a template: passed through to one that references
    `tools`; otherwise rewritten into the built-in format, `prompt`'s (and no tools for the template)."""
    if template_supports_tools:
        return template_messages(messages), list(tools) if tools else None
    if tools or uses_tool_history(messages):
        return builtin_messages(messages, tools, prompt), None
    return list(messages), None
