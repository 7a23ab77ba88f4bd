"""OpenAI's request bodies as pydantic models, their translation into the frontend's core requests
(GenerationRequest, the form the gRPC API decodes into too, so that one admission,
services/common/admission.py, judges both APIs), and the error bodies for requests refused.
The response bodies are openai_responses.py. Pure functions: no I/O."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Literal, cast

import grpc
from pydantic import BaseModel, ConfigDict, Field

from vmesh.services.common import generation
from vmesh.services.common.generation import Chat, GenerationRequest, ToolCall
from vmesh.services.common.types import DEFAULT_MAX_TOKENS, MAX_LOGPROBS, OutputMode, SamplingParams, StructuredOutput
from vmesh.services.common.wire.public import as_carried
from vmesh.services.frontend import tool_calls
from vmesh.services.frontend.errors import Code, RequestError
from vmesh.services.frontend.inputs import CHAT_ROLES, ROLES_ACCEPTED
from vmesh.services.frontend.structured_requests import request_spec, structured_aliases

MAX_CHOICES = 64  # n × prompts per HTTP request: each is a request in the scheduler
# OpenAI's own cap for completions' `logprobs` (chat's `top_logprobs` has the mesh's, 20, as
# OpenAI's). Each top entry is a token to render per generated token: the cap bounds a response.
MAX_COMPLETION_LOGPROBS = 5
SEED_MASK = (1 << 64) - 1


class RequestBody(BaseModel):
    # Unknown fields are ignored, as vLLM ignores them; NaN and infinities are refused as JSON
    # cannot carry them and no sampling parameter means anything with them.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(RequestBody):
    include_usage: bool = False


class _SamplingBody(RequestBody):
    """The fields both endpoints share: OpenAI's, then vLLM's extras."""

    model: str | None = Field(None, description="the served model's id; omitted: the served model")
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = Field(None, description="accepted and ignored")
    logit_bias: dict[str, float] | None = Field(None, description="not supported: refused unless empty")
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    stop_token_ids: list[int] | None = None
    priority: int | None = None
    prompt_logprobs: int | None = Field(
        None, description="vLLM's: each prompt token's logprob, rank and the top N at its position (the first "
                          "token's null); a request that asks recomputes its whole prompt (no prefix-cache reads)")
    response_format: dict[str, Any] | None = Field(
        None, description="{'type': 'text'} | {'type': 'json_object'} | {'type': 'json_schema', 'json_schema': "
                          "{'name', 'schema', 'strict', 'description'}}; the schema is enforced, strict or not")
    structured_outputs: dict[str, Any] | None = Field(
        None, description="vLLM's: exactly one of json, regex, choice, grammar, structural_tag, json_object: true; "
                          "vmesh's backend: auto, xgrammar or llguidance")


class CompletionRequest(_SamplingBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = Field(None, description="each choice's text starts with the prompt; with logprobs, so do "
                                                "its logprobs (the first prompt token's null); max_tokens 0 with "
                                                "echo generates nothing")
    suffix: str | None = Field(None, description="not supported: refused unless empty")
    best_of: int | None = Field(None, description="not supported: refused above 1")


class ChatMessage(RequestBody):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = Field(None, description="an assistant's calls (content may be null)")
    tool_call_id: str | None = Field(None, description="role 'tool': the call it answers")
    function_call: dict[str, Any] | None = Field(None, description="legacy: an assistant's one call")


class ChatCompletionRequest(_SamplingBody):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = Field(None, description="function tools: [{'type': 'function', 'function': {...}}]")
    tool_choice: str | dict[str, Any] | None = Field(
        None, description="'none', 'auto' (default with tools), 'required' or {'type': 'function', 'function': "
                          "{'name': ...}}")
    functions: list[Any] | None = Field(None, description="legacy form of tools")
    function_call: str | dict[str, Any] | None = Field(None, description="legacy form of tool_choice")
    parallel_tool_calls: bool | None = Field(None, description="false: one call at most")


def invalid(param: str, message: str) -> RequestError:
    return RequestError(Code.INVALID_ARGUMENT, f"{param}: {message}", param)


def _refuse_unsupported(body: CompletionRequest | ChatCompletionRequest) -> None:
    if body.logit_bias:
        raise invalid("logit_bias", "not supported by vmesh")
    if body.prompt_logprobs is not None and body.stream:
        raise invalid("prompt_logprobs", "not supported with stream by vmesh")
    if isinstance(body, CompletionRequest):
        if body.echo and body.stream:
            raise invalid("echo", "not supported with stream by vmesh")
        if body.suffix:
            raise invalid("suffix", "not supported by vmesh")
        if body.best_of is not None and body.best_of != 1:
            raise invalid("best_of", "not supported by vmesh (use n)")
        return


def utf8_text(param: str, value: str) -> str:
    """`value` if it can be sent as UTF-8: JSON's \\ud800 escapes decode to lone surrogates,
    which protobuf (and every later step) refuses."""
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        raise invalid(param, f"not valid Unicode (a lone surrogate at offset {exc.start})") from exc
    return value


def _carried(path: str, value: Any, param: str) -> Any:
    """`value` as the gRPC API's field `path` would carry it, a value outside the field's range a
    400 naming `param`: both APIs then serve the same request."""
    try:
        return as_carried(path, value)
    except (ValueError, TypeError) as exc:
        raise invalid(param, f"{value!r} is out of range ({exc})") from exc


_SAMPLING_FIELDS = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k", "min_p",
                    "repetition_penalty", "min_tokens", "ignore_eos", "skip_special_tokens",
                    "include_stop_str_in_output", "stop_token_ids", "prompt_logprobs")


def _sampling(body: CompletionRequest | ChatCompletionRequest, max_tokens: int | None,
              logprobs: int | None, structured: StructuredOutput | None = None) -> SamplingParams:
    """The body's sampling settings; those it leaves out take SamplingParams' defaults (max_tokens
    unset: the caller's request fills in the context's room)."""
    params = SamplingParams(output_mode=OutputMode.DELTA, structured=structured)
    if max_tokens is not None:
        params.max_tokens = _carried("sampling.max_tokens", max_tokens, "max_completion_tokens" if getattr(
            body, "max_completion_tokens", None) is not None else "max_tokens")
    for name in _SAMPLING_FIELDS:
        value = getattr(body, name)
        if value is not None:
            setattr(params, name, _carried(f"sampling.{name}", value, name))
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    if stop is not None:
        params.stop = [utf8_text("stop", s) for s in stop]
    if body.seed is not None:
        params.seed = body.seed & SEED_MASK  # OpenAI's seeds may be negative; the same seed, the same draw
    if logprobs is not None:
        params.logprobs = _carried("sampling.logprobs", logprobs, "logprobs")
    return params


def _priority(body: CompletionRequest | ChatCompletionRequest) -> int:
    return _carried("priority", body.priority, "priority") if body.priority is not None else 0


def unknown_model(model: str, served: str) -> RequestError:
    return RequestError(Code.NOT_FOUND, f"model: the model {model!r} does not exist (this server serves {served!r})",
                        "model")


def check_model(model: str | None, served: str) -> None:
    """A request's `model`: unset, or the served model's name."""
    if model is not None and model != served:
        raise unknown_model(model, served)


def check_common(body: CompletionRequest | ChatCompletionRequest, served: str) -> None:
    check_model(body.model, served)
    _refuse_unsupported(body)
    if body.n < 1:
        raise invalid("n", f"must be >= 1, got {body.n}")
    if body.stream_options is not None and not body.stream:
        raise invalid("stream_options", "only allowed when stream is true")


def echo_without_generation(body: CompletionRequest) -> bool:
    return bool(body.echo) and body.max_tokens == 0


def completion_requests(body: CompletionRequest, served: str) -> list[GenerationRequest]:
    """One request per prompt (n copies are made by fan_out)."""
    check_common(body, served)
    prompt = body.prompt
    one = isinstance(prompt, str) or (prompt and isinstance(prompt[0], int))
    prompts = cast("list[str | list[int]]", [prompt] if one else list(prompt))
    if not prompts:
        raise invalid("prompt", "empty")
    if len(prompts) * body.n > MAX_CHOICES:
        raise invalid("n", f"{len(prompts)} prompts × n={body.n} choices; at most {MAX_CHOICES} per request")
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_COMPLETION_LOGPROBS:
        raise invalid("logprobs", f"must be in [0, {MAX_COMPLETION_LOGPROBS}], got {body.logprobs}")
    spec = request_spec(body.response_format, body.structured_outputs)
    max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_MAX_TOKENS
    # echo with max_tokens 0 scores the prompt alone: one token is generated and left out of the reply.
    sampling = _sampling(body, 1 if echo_without_generation(body) else max_tokens, body.logprobs,
                         spec[0] if spec else None)
    if body.echo and body.logprobs is not None:  # the prompt's tokens are scored as the generated ones are
        sampling.prompt_logprobs = max(body.logprobs, sampling.prompt_logprobs or 0)
    priority = _priority(body)
    # One SamplingParams for every prompt: admission gives each request its own copy.
    return [GenerationRequest(utf8_text("prompt", p) if isinstance(p, str) else _carried("token_ids.ids", p, "prompt"),
                              sampling, priority=priority) for p in prompts]


def _content_text(i: int, message: ChatMessage, optional: bool = False) -> str:
    content = message.content
    if content is None and optional:
        return ""
    if content is None:
        raise invalid(f"messages[{i}].content", "required")
    if isinstance(content, str):
        return utf8_text(f"messages[{i}].content", content)
    parts = []
    for j, part in enumerate(content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise invalid(f"messages[{i}].content[{j}]", "only text parts ({'type': 'text', 'text': ...}) "
                                                         "are supported by vmesh")
        parts.append(utf8_text(f"messages[{i}].content[{j}].text", part["text"]))
    return "\n".join(parts)


def _tool_call(param: str, call: Any) -> ToolCall:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise invalid(f"{param}.function.name", "required")
    arguments = function.get("arguments", "{}")
    if not isinstance(arguments, str):
        raise invalid(f"{param}.function.arguments", "must be a string (the arguments as JSON text)")
    call_id = call.get("id", "")
    if not isinstance(call_id, str):
        raise invalid(f"{param}.id", "must be a string")
    return ToolCall(utf8_text(f"{param}.id", call_id), utf8_text(f"{param}.function.name", function["name"]),
                    utf8_text(f"{param}.function.arguments", arguments))


def chat_message(i: int, m: ChatMessage) -> generation.ChatMessage:
    role = CHAT_ROLES.get(m.role)
    if role is None:
        raise invalid(f"messages[{i}].role", f"{m.role!r} is not supported ({ROLES_ACCEPTED})")
    calls = list(m.tool_calls or ())
    if m.function_call is not None:  # the legacy form of one call
        calls.append({"id": "", "type": "function", "function": m.function_call})
    if calls and role != "assistant":
        raise invalid(f"messages[{i}].tool_calls", "only assistant messages make tool calls")
    message = generation.ChatMessage(role, _content_text(i, m, optional=bool(calls)),
                              [_tool_call(f"messages[{i}].tool_calls[{j}]", c) for j, c in enumerate(calls)])
    if role == "tool":
        call_id = m.tool_call_id if m.role == "tool" else m.name  # legacy "function" results name the function
        if not call_id:
            raise invalid(f"messages[{i}].tool_call_id" if m.role == "tool" else f"messages[{i}].name", "required")
        message.tool_call_id = utf8_text(f"messages[{i}].tool_call_id", call_id)
    return message


def chat_tools(body: ChatCompletionRequest) -> tool_calls.ToolPlan:
    """The request's tool fields, checked. A forced choice ("required", a named function) is served
    with its output held to tool_calls.plan_schema (chat_spec)."""
    return tool_calls.tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls, body.functions,
                                body.function_call)


def chat_spec(body: ChatCompletionRequest, tools: tool_calls.ToolPlan) -> tuple[StructuredOutput, str] | None:
    """The structured output a chat request asks for (response_format, structured_outputs or a
    forced tool choice: one at most) and the field it came from."""
    return request_spec(body.response_format, body.structured_outputs, tool_calls.plan_schema(tools))


def chat_request(body: ChatCompletionRequest, served: str,
                 tools: tool_calls.ToolPlan | None = None) -> GenerationRequest:
    """`tools`: chat_tools(body), when the caller has it already."""
    check_common(body, served)
    tools = tools if tools is not None else chat_tools(body)
    if not body.messages:
        raise invalid("messages", "at least one message is required")
    if body.n > MAX_CHOICES:
        raise invalid("n", f"at most {MAX_CHOICES}")
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("top_logprobs", "requires logprobs: true")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
        raise invalid("top_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {body.top_logprobs}")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    spec = chat_spec(body, tools)
    sampling = _sampling(body, max_tokens, logprobs, spec[0] if spec else None)
    chat = Chat([chat_message(i, m) for i, m in enumerate(body.messages)],
                utf8_text("tools", tool_calls.tools_json(tools)))
    return GenerationRequest(chat, sampling, max_tokens_from_context=max_tokens is None, priority=_priority(body))


def fan_out(requests: list[GenerationRequest], n: int, prompts: list[list[int]]) -> list[GenerationRequest]:
    """n copies of each request, choice index = prompt index × n + copy. `prompts`: each
    request's token ids, tokenized once: the copies carry the ids rather than the text, so that
    n copies cost one tokenization. The copies share the prompt's KV blocks through the prefix
    cache; a seeded request's copies get seed + copy, so that they differ yet reproduce."""
    out = []
    for request, ids in zip(requests, prompts, strict=True):
        seed = request.sampling.seed
        for j in range(n):
            sampling = replace(request.sampling, seed=(seed + j) & SEED_MASK) if j and seed is not None \
                else request.sampling
            out.append(replace(request, prompt=ids, sampling=sampling))
    return out


ErrorType = Literal["invalid_request_error", "authentication_error", "rate_limit_error",
                    "service_unavailable_error", "timeout_error", "internal_error"]
HTTP_STATUS: dict[grpc.StatusCode, tuple[int, ErrorType]] = {
    Code.INVALID_ARGUMENT: (400, "invalid_request_error"),
    Code.UNAUTHENTICATED: (401, "authentication_error"),
    Code.NOT_FOUND: (404, "invalid_request_error"),  # OpenAI's type for an unknown model, with its code
    Code.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    Code.UNAVAILABLE: (503, "service_unavailable_error"),
    Code.DEADLINE_EXCEEDED: (504, "timeout_error"),
}


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def param_aliases(body: CompletionRequest | ChatCompletionRequest,
                  tools: tool_calls.ToolPlan | None = None) -> dict[str, str]:
    """The gRPC API's field names (sampling's without their `sampling.`) as this HTTP body spells
    them (`tools`: a chat body's plan, whose forced choice is its structured output)."""
    if isinstance(body, CompletionRequest):
        spec = request_spec(body.response_format, body.structured_outputs)
        return {"token_ids": "prompt", "input": "prompt", **structured_aliases(spec[1] if spec else None)}
    aliases = {"prompt": "messages", "chat": "messages", "input": "messages"}
    if body.max_completion_tokens is not None:
        aliases["max_tokens"] = "max_completion_tokens"
    spec = chat_spec(body, tools) if tools is not None else request_spec(body.response_format, body.structured_outputs)
    return {**aliases, **structured_aliases(spec[1] if spec else None)}


# What pydantic puts in an error's location besides fields and indexes: the member of a union
# ("str", "list[int]") or a validator's name ("function-after[...]").
_PYDANTIC_TAG = re.compile(r"^(str|int|float|bool|dict|list|none)$|^[a-z_-]+\[.*\]$")
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def json_path(loc: Sequence[str | int]) -> str | None:
    """A pydantic error location (("body", "messages", 0, "content", "str")) in the one notation
    every `param` of the HTTP API uses, vmesh's own: messages[0].content. None: the body itself."""
    path = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not _PYDANTIC_TAG.match(part):
            path += (f".{part}" if path else part) if _IDENTIFIER.match(part) else f"[{json.dumps(part)}]"
    return path or None


def _aliased(name: str, aliases: dict[str, str]) -> str:
    """`name` (a.b.c) renamed by its longest aliased prefix."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        head = ".".join(parts[:end])
        if head in aliases:
            return ".".join([aliases[head], *parts[end:]])
    return name


def request_error_body(exc: RequestError, aliases: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    """`aliases`: param_aliases of the HTTP request refused (token_ids -> prompt)."""
    status, error_type = HTTP_STATUS.get(exc.code, (500, "internal_error"))
    code = "invalid_api_key" if exc.code == Code.UNAUTHENTICATED else None
    if exc.code == Code.NOT_FOUND and exc.field == "model":
        code = "model_not_found"
    param = None
    message = exc.message
    if exc.field is not None:
        name = exc.field.removeprefix("sampling.")
        param = _aliased(name, aliases or {})
        if param != exc.field and message.startswith(f"{exc.field}: "):  # the message names it as the body does
            message = f"{param}{message[len(exc.field):]}"
    return status, error_body(message, error_type, param, code)
