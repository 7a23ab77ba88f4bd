"""OpenAI's Responses API (POST /v1/responses) as a view over chat completions: a Responses request
is translated into the chat request body (openai_protocol.ChatCompletionRequest), which chat's own
translation, admission, sampling and output accumulation then serve; the chat completion body is
turned back into a Response object (the streamed events are responses_events.py). Stateless: no
response is stored, so nothing can refer to an earlier one. Pure functions: no I/O."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field, ValidationError

from vmesh.services.common.generation import GenerationRequest
from vmesh.services.frontend import openai_protocol as oai
from vmesh.services.frontend import tool_calls
from vmesh.services.frontend.errors import RequestError

STATELESS = "vmesh keeps no responses (it is stateless); send the whole conversation in `input`"
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")
TEXT_FORMATS = ("text", "json_schema", "json_object")
TOOL_CHOICE_MODES = ("none", "auto", "required")


class ResponsesRequest(oai.RequestBody):
    """The fields vmesh reads; other unknown fields are ignored (as chat ignores them), and the
    ones below described "refused" are refused with a 400 naming them."""

    model: str | None = Field(None, description="the served model's id; omitted: the served model")
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = Field(None, description="a system message ahead of `input`")
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: dict[str, Any] | None = Field(None, description="`format`: text, json_schema or json_object")
    tools: list[dict[str, Any]] | None = Field(None, description="function tools only")
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = Field(None, description="echoed in the response")
    store: bool | None = Field(None, description="accepted; nothing is stored (vmesh is stateless)")
    user: str | None = Field(None, description="accepted and ignored")
    previous_response_id: str | None = Field(None, description="refused: " + STATELESS)
    conversation: str | dict[str, Any] | None = Field(None, description="refused: " + STATELESS)
    background: bool | None = Field(None, description="refused when true")
    reasoning: dict[str, Any] | None = Field(None, description="refused unless empty")
    include: list[str] | None = Field(None, description="refused unless empty")
    top_logprobs: int | None = Field(None, description="refused unless 0")
    truncation: str | None = Field(None, description="only 'disabled'")
    max_tool_calls: int | None = Field(None, description="refused")
    prompt: dict[str, Any] | None = Field(None, description="refused (no stored prompts)")


def _refuse_unsupported(body: ResponsesRequest) -> None:
    if body.previous_response_id is not None:
        raise oai.invalid("previous_response_id", STATELESS)
    if body.conversation is not None:
        raise oai.invalid("conversation", STATELESS)
    if body.prompt is not None:
        raise oai.invalid("prompt", "stored prompts are not supported by vmesh")
    if body.background:
        raise oai.invalid("background", "background responses are not supported by vmesh (it stores none)")
    if body.reasoning and any(v is not None for v in body.reasoning.values()):
        raise oai.invalid("reasoning", "reasoning options are not supported by vmesh")
    if body.include:
        raise oai.invalid("include", "not supported by vmesh")
    if body.top_logprobs:
        raise oai.invalid("top_logprobs", "not supported by vmesh's Responses API (chat completions has logprobs)")
    if body.truncation not in (None, "disabled"):
        raise oai.invalid("truncation", "only 'disabled' is supported by vmesh")
    if body.max_tool_calls is not None:
        raise oai.invalid("max_tool_calls", "not supported by vmesh")


@dataclass
class Source:
    """Where a chat message came from in the Responses request, to name it in errors: `path` (e.g.
    "input[2]"); `content`: what its chat `content` is called there (None: the path itself);
    `calls`: the paths of the function_call items its `tool_calls` came from."""

    path: str
    content: str | None = "content"
    calls: list[str] = field(default_factory=list)

    def name(self, rest: str) -> str:
        """The Responses path of `messages[k]<rest>`."""
        if rest.startswith(".tool_calls[") and self.calls:
            index = int(rest[len(".tool_calls["):rest.index("]")])
            return self.calls[min(index, len(self.calls) - 1)]
        if self.content is None:
            return self.path
        if rest.startswith(".content"):
            return f"{self.path}.{self.content}{rest.removeprefix('.content')}"
        return self.path + rest


def _text(param: str, value: Any) -> str:
    if not isinstance(value, str):
        raise oai.invalid(param, "must be a string")
    return value


def _content(param: str, content: Any) -> str | list[dict[str, Any]]:
    """A message's content (a string or input_text/output_text parts) as chat's content."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise oai.invalid(param, "must be a string or a list of content parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise oai.invalid(f"{param}[{j}].type", f"{kind!r}: only text parts ({', '.join(TEXT_PARTS)}) "
                                                     "are supported by vmesh")
        parts.append({"type": "text", "text": _text(f"{param}[{j}].text", part.get("text"))})
    return parts


def _output(param: str, output: Any) -> str:
    """A function_call_output's output (a string, or text parts) as a tool message's content."""
    if isinstance(output, str):
        return output
    parts = _content(param, output)
    return parts if isinstance(parts, str) else "".join(p["text"] for p in parts)


def chat_messages(body: ResponsesRequest) -> tuple[list[dict[str, Any]], list[Source]]:
    """`instructions` then `input`, as chat messages; and where each came from."""
    messages: list[dict[str, Any]] = []
    sources: list[Source] = []
    if body.instructions is not None:
        messages.append({"role": "system", "content": body.instructions})
        sources.append(Source("instructions", None))
    if body.input is None:
        raise oai.invalid("input", "required (vmesh keeps no responses or prompts to continue from)")
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
        sources.append(Source("input", None))
        return messages, sources
    for i, item in enumerate(body.input):
        path = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise oai.invalid(f"{path}.role", f"{role!r} is not supported ({', '.join(ROLES)})")
            messages.append({"role": role, "content": _content(f"{path}.content", item.get("content"))})
            sources.append(Source(path))
        elif kind == "function_call":
            call = {"id": _text(f"{path}.call_id", item.get("call_id")), "type": "function",
                    "function": {"name": _text(f"{path}.name", item.get("name")),
                                 "arguments": _text(f"{path}.arguments", item.get("arguments"))}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                # The calls of one assistant turn follow its text: one chat message holds them all.
                last.setdefault("tool_calls", []).append(call)
                sources[-1].calls.append(path)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                sources.append(Source(path, calls=[path]))
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _text(f"{path}.call_id", item.get("call_id")),
                             "content": _output(f"{path}.output", item.get("output"))})
            sources.append(Source(path, "output"))
        elif kind == "item_reference":
            raise oai.invalid(f"{path}.type", STATELESS)
        else:
            raise oai.invalid(f"{path}.type", f"{kind!r} items are not supported by vmesh "
                                              "(message, function_call, function_call_output)")
    return messages, sources


def text_format(body: ResponsesRequest) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format` (None: plain text)."""
    fmt = (body.text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in TEXT_FORMATS:
        raise oai.invalid("text.format.type", f"{kind!r} is not supported ({', '.join(TEXT_FORMATS)})")
    if kind == "text":
        return None
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "description", "schema", "strict")
                                                       if k in fmt}}
    return {"type": kind}


def chat_tools(body: ResponsesRequest) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat's ({"type": "function", "function": {...}})."""
    if body.tools is None:
        return None
    tools = []
    for i, tool in enumerate(body.tools):
        if tool.get("type") != "function":
            raise oai.invalid(f"tools[{i}].type", f"{tool.get('type')!r}: only function tools are supported "
                                                  "by vmesh (no built-in tools)")
        tools.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters",
                                                                            "strict") if k in tool}})
    return tools


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or choice in TOOL_CHOICE_MODES:
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": _text("tool_choice.name", choice.get("name"))}}
    kind = choice.get("type") if isinstance(choice, dict) else choice
    raise oai.invalid("tool_choice", f"{kind!r} is not supported ({', '.join(TOOL_CHOICE_MODES)}, or "
                                     "{'type': 'function', 'name': ...})")


def chat_body(body: ResponsesRequest) -> tuple[dict[str, Any], list[Source]]:
    """The chat completions body that serves this request (in chat's shape, so that what chat
    accepts, Responses accepts), and where each of its messages came from."""
    _refuse_unsupported(body)
    messages, sources = chat_messages(body)
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "stream": body.stream}
    optional = {"max_completion_tokens": body.max_output_tokens, "temperature": body.temperature,
                "top_p": body.top_p, "response_format": text_format(body), "tools": chat_tools(body),
                "tool_choice": chat_tool_choice(body.tool_choice), "parallel_tool_calls": body.parallel_tool_calls}
    chat.update({k: v for k, v in optional.items() if v is not None})
    return chat, sources


# Chat's names of fields -> the Responses API's (messages[k] goes by `Source`).
RENAMED = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
           "response_format": "text.format", "prompt": "input", "chat": "input", "input": "input",
           "token_ids": "input", "structured": "text.format", "structured.source": "text.format.schema"}


def responses_name(chat_field: str, sources: list[Source]) -> str:
    """A chat request's field as the Responses request that became it names it."""
    if chat_field.startswith("messages[") and "]" in chat_field:
        end = chat_field.index("]")
        index = int(chat_field[len("messages["):end])
        if index < len(sources):
            return sources[index].name(chat_field[end + 1:])
    head, dot, rest = chat_field.partition(".")
    if head.startswith("tools[") and rest.startswith("function"):  # chat nests what Responses keeps flat
        return head + rest.removeprefix("function")
    if head == "tool_choice" and rest == "function.name":
        return "tool_choice.name"
    return RENAMED.get(head, head) + dot + rest


def renamed(exc: RequestError, sources: list[Source]) -> RequestError:
    if exc.field is None:
        return exc
    name = responses_name(exc.field.removeprefix("sampling."), sources)
    prefix = f"{exc.field}: "
    message = f"{name}: {exc.message.removeprefix(prefix)}" if exc.message.startswith(prefix) else exc.message
    return RequestError(exc.code, message, name)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class ResponsesView:
    """One Responses request's reply, built over chat's: its ids and the request parameters the
    Response object echoes."""

    body: ResponsesRequest
    model: str
    response_id: str = field(default_factory=lambda: new_id("resp"))
    message_id: str = field(default_factory=lambda: new_id("msg"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    @property
    def aliases(self) -> dict[str, str]:
        """The gRPC API's field names (sampling's without their `sampling.`) as this API spells them."""
        return RENAMED

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        """The Response object: `status` in_progress, completed or incomplete (its output cut by
        max_output_tokens)."""
        body = self.body
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at, "status": status,
            "error": None, "model": self.model, "output": output, "usage": usage,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
            "tools": body.tools or [], "tool_choice": body.tool_choice or "auto",
            "parallel_tool_calls": True if body.parallel_tool_calls is None else body.parallel_tool_calls,
            "metadata": body.metadata or {}, "previous_response_id": None, "reasoning": None,
            "store": False, "truncation": "disabled", "user": body.user, "background": False,
        }

    def from_chat(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The Response object of a chat completion body (openai_responses.chat_body)."""
        choice = chat["choices"][0]
        message = choice["message"]
        status = response_status(choice["finish_reason"])
        calls = message.get("tool_calls") or []
        output = []
        if message.get("content") or not calls:
            output.append(message_item(self.message_id, message.get("content") or "", "completed"))
        output += [function_call_item(new_id("fc"), c["id"], c["function"]["name"], c["function"]["arguments"],
                                      "completed") for c in calls]
        output[-1]["status"] = status  # the item the output was cut in (streamed: the one still open)
        return self.response(status, output, responses_usage(chat["usage"]))


def response_status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    """An assistant message item; `text` None: opened, no content part yet."""
    content = [] if text is None else [output_text(text)]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def responses_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """Chat's usage as the Responses API's (vmesh writes no prompt to a cache it bills: 0 written)."""
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


def translate(body: ResponsesRequest, served: str,
              ) -> tuple[GenerationRequest, ResponsesView, tool_calls.ToolPlan]:
    """The request that serves a Responses request, made by chat's own translation (so that
    chat's checks and refusals apply, named as this API names the fields), and its reply's view."""
    chat, sources = chat_body(body)
    try:
        chat_request = oai.ChatCompletionRequest.model_validate(chat)
        tools = oai.chat_tools(chat_request)
        request = oai.chat_request(chat_request, served, tools)
    except ValidationError as exc:  # a value chat's body cannot hold (e.g. a tool that is not an object)
        first = exc.errors()[0]
        loc = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in first["loc"]).removeprefix(".")
        name = responses_name(loc, sources)
        raise oai.invalid(name, first["msg"]) from None
    except RequestError as exc:
        raise renamed(exc, sources) from None
    return request, ResponsesView(body, served), tools
