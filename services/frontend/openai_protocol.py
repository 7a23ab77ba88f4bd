"""OpenAI's request bodies as pydantic models, their translation into the GenerateRequests the
gRPC API takes (so that one validation, validate_generate, judges both APIs), and the response
bodies built from GenerateResponses. Pure functions: no I/O."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from vmesh.services.frontend.requests import Code, RequestError
from vmesh.v1 import common_pb2, frontend_pb2

MAX_CHOICES = 64  # n × prompts per HTTP request: each is a request in the scheduler
# OpenAI's own caps: completions' `logprobs` at most 5, chat's `top_logprobs` at most 20. Each
# top entry is a token to render per generated token, so the cap bounds a response's size.
MAX_COMPLETION_LOGPROBS = 5
MAX_TOP_LOGPROBS = 20
SEED_MASK = (1 << 64) - 1
# JSON has no -inf: a logprob that underflowed is sent as this, as vLLM does.
MIN_LOGPROB = -9999.0
# Only OpenAI's values: "abort" (which vLLM passes through) breaks clients that switch on the
# enum, and an aborted request did not complete, so it is reported as an error instead.
FINISH_REASONS = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length"}


class _Body(BaseModel):
    # Unknown fields are ignored, as vLLM ignores them; NaN and infinities are refused as JSON
    # cannot carry them and no sampling parameter means anything with them.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingBody(_Body):
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


class CompletionRequest(_SamplingBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = Field(None, description="not supported: refused when true")
    suffix: str | None = Field(None, description="not supported: refused unless empty")
    best_of: int | None = Field(None, description="not supported: refused above 1")


class ChatMessage(_Body):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingBody):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = Field(None, description="not supported: refused unless empty")
    tool_choice: str | dict[str, Any] | None = Field(None, description="not supported: refused unless 'none'")
    functions: list[dict[str, Any]] | None = Field(None, description="not supported: refused unless empty")
    function_call: str | dict[str, Any] | None = Field(None, description="not supported: refused unless 'none'")
    response_format: dict[str, Any] | None = Field(None, description="only {'type': 'text'}")
    parallel_tool_calls: bool | None = Field(None, description="accepted and ignored")


def invalid(param: str, message: str) -> RequestError:
    return RequestError(Code.INVALID_ARGUMENT, f"{param}: {message}")


def _refuse_unsupported(body: CompletionRequest | ChatCompletionRequest) -> None:
    if body.logit_bias:
        raise invalid("logit_bias", "not supported by vmesh")
    if isinstance(body, CompletionRequest):
        if body.echo:
            raise invalid("echo", "not supported by vmesh")
        if body.suffix:
            raise invalid("suffix", "not supported by vmesh")
        if body.best_of is not None and body.best_of != 1:
            raise invalid("best_of", "not supported by vmesh (use n)")
        return
    for name in ("tools", "functions"):
        if getattr(body, name):
            raise invalid(name, "tool calling is not supported by vmesh")
    for name in ("tool_choice", "function_call"):
        if getattr(body, name) not in (None, "none"):
            raise invalid(name, "tool calling is not supported by vmesh")
    if body.response_format is not None and body.response_format.get("type", "text") != "text":
        raise invalid("response_format", "only {'type': 'text'} is supported by vmesh")


def _text(param: str, value: str) -> str:
    """`value` if it can be sent as UTF-8: JSON's \\ud800 escapes decode to lone surrogates,
    which protobuf (and every later step) refuses."""
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        raise invalid(param, f"not valid Unicode (a lone surrogate at offset {exc.start})") from exc
    return value


def _set(message: Any, name: str, value: Any, param: str | None = None) -> None:
    """Set a proto field, turning a value outside the field's range into a 400 naming it."""
    if value is None:
        return
    try:
        if isinstance(value, list):
            getattr(message, name).extend(value)
        else:
            setattr(message, name, value)
    except (ValueError, TypeError) as exc:
        raise invalid(param or name, f"{value!r} is out of range ({exc})") from exc


def _sampling(body: CompletionRequest | ChatCompletionRequest, max_tokens: int | None,
              logprobs: int | None) -> common_pb2.SamplingParams:
    pb = common_pb2.SamplingParams(output_mode=common_pb2.OUTPUT_MODE_DELTA)
    _set(pb, "max_tokens", max_tokens, "max_completion_tokens" if getattr(body, "max_completion_tokens", None)
         is not None else "max_tokens")
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k", "min_p",
                 "repetition_penalty", "min_tokens", "ignore_eos", "skip_special_tokens",
                 "include_stop_str_in_output", "stop_token_ids"):
        _set(pb, name, getattr(body, name))
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    _set(pb, "stop", [_text("stop", s) for s in stop] if stop is not None else None)
    if body.seed is not None:
        pb.seed = body.seed & SEED_MASK  # OpenAI's seeds may be negative; the same seed, the same draw
    _set(pb, "logprobs", logprobs)
    return pb


def check_common(body: CompletionRequest | ChatCompletionRequest, served: str) -> None:
    if body.model is not None and body.model != served:
        raise RequestError(Code.NOT_FOUND, f"model: the model {body.model!r} does not exist "
                                           f"(this server serves {served!r})")
    _refuse_unsupported(body)
    if body.n < 1:
        raise invalid("n", f"must be >= 1, got {body.n}")
    if body.stream_options is not None and not body.stream:
        raise invalid("stream_options", "only allowed when stream is true")


def completion_requests(body: CompletionRequest, served: str) -> list[frontend_pb2.GenerateRequest]:
    """One GenerateRequest per prompt (n copies are made by fan_out)."""
    check_common(body, served)
    prompt = body.prompt
    prompts: list[str | list[int]] = [prompt] if isinstance(prompt, str) or (
        prompt and isinstance(prompt[0], int)) else list(prompt)
    if not prompts:
        raise invalid("prompt", "empty")
    if len(prompts) * body.n > MAX_CHOICES:
        raise invalid("n", f"{len(prompts)} prompts × n={body.n} choices; at most {MAX_CHOICES} per request")
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_COMPLETION_LOGPROBS:
        raise invalid("logprobs", f"must be in [0, {MAX_COMPLETION_LOGPROBS}], got {body.logprobs}")
    sampling = _sampling(body, body.max_tokens if body.max_tokens is not None else 16, body.logprobs)
    out = []
    for p in prompts:
        request = frontend_pb2.GenerateRequest(sampling=sampling)
        _set(request, "priority", body.priority)
        if isinstance(p, str):
            request.text = _text("prompt", p)
        else:
            request.token_ids.SetInParent()
            _set(request.token_ids, "ids", list(p), "prompt")
        out.append(request)
    return out


def _content_text(i: int, message: ChatMessage) -> str:
    content = message.content
    if content is None:
        raise invalid(f"messages[{i}].content", "required")
    if isinstance(content, str):
        return _text(f"messages[{i}].content", content)
    parts = []
    for j, part in enumerate(content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise invalid(f"messages[{i}].content[{j}]", "only text parts ({'type': 'text', 'text': ...}) "
                                                         "are supported by vmesh")
        parts.append(_text(f"messages[{i}].content[{j}].text", part["text"]))
    return "\n".join(parts)


CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def chat_request(body: ChatCompletionRequest, served: str) -> frontend_pb2.GenerateRequest:
    check_common(body, served)
    if not body.messages:
        raise invalid("messages", "at least one message is required")
    if body.n > MAX_CHOICES:
        raise invalid("n", f"at most {MAX_CHOICES}")
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("top_logprobs", "requires logprobs: true")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_TOP_LOGPROBS:
        raise invalid("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {body.top_logprobs}")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    request = frontend_pb2.GenerateRequest(sampling=_sampling(body, max_tokens, logprobs))
    _set(request, "priority", body.priority)
    request.chat.SetInParent()
    for i, m in enumerate(body.messages):
        role = CHAT_ROLES.get(m.role)
        if role is None:
            raise invalid(f"messages[{i}].role", f"{m.role!r} is not supported (system, developer, user, assistant)")
        request.chat.messages.append(frontend_pb2.ChatMessage(role=role, content=_content_text(i, m)))
    return request


def fan_out(requests: list[frontend_pb2.GenerateRequest], n: int,
            prompts: list[list[int]]) -> list[frontend_pb2.GenerateRequest]:
    """n copies of each request, choice index = prompt index × n + copy. `prompts`: each
    request's token ids, tokenized once: the copies carry the ids rather than the text, so that
    n copies cost one tokenization. The copies share the prompt's KV blocks through the prefix
    cache; a seeded request's copies get seed + copy, so that they differ yet reproduce."""
    out = []
    for request, ids in zip(requests, prompts, strict=True):
        template = frontend_pb2.GenerateRequest()
        template.CopyFrom(request)
        template.ClearField("input")
        template.token_ids.ids.extend(ids)
        for j in range(n):
            copy = frontend_pb2.GenerateRequest()
            copy.CopyFrom(template)
            if j and copy.sampling.HasField("seed"):
                copy.sampling.seed = (copy.sampling.seed + j) & SEED_MASK
            out.append(copy)
    return out


# --- responses ---------------------------------------------------------------------------------

@dataclass
class Choice:
    """What one choice has received so far."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[frontend_pb2.GeneratedTokenLogprobs] = field(default_factory=list)
    finish_reason: int = 0
    usage: frontend_pb2.Usage | None = None

    def add(self, out: frontend_pb2.GenerateResponse) -> None:
        self.text += out.text
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs
        self.finish_reason = out.finish_reason or self.finish_reason
        if out.HasField("usage"):
            self.usage = out.usage


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def _lp(value: float) -> float:
    return max(float(value), MIN_LOGPROB)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the character each byte is written as in a
    byte-level BPE vocabulary -> that byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


BYTE_DECODER = _byte_decoder()


class TokenTexts(Protocol):
    def text(self, token_id: int) -> str: ...

    def raw(self, token_id: int) -> bytes: ...


class TokenTable:
    """Each token id's text and raw bytes, computed at most once per id: rendering logprobs
    names every sampled and every top token, and decoding them one by one on the event loop
    stalls every other request (n × max_tokens × (1 + top) decodes per response). Bounded by
    the vocabulary; filled lazily, as decoding a whole vocabulary up front is itself a stall."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}
        self._raw: dict[int, bytes] = {}
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._byte_level = "ByteLevel" in type(getattr(backend, "decoder", None)).__name__
        self._added = {i for i in (getattr(tokenizer, "added_tokens_decoder", None) or {})}

    def text(self, token_id: int) -> str:
        text = self._text.get(token_id)
        if text is None:
            text = self._text[token_id] = self.tokenizer.decode([token_id])
        return text

    def raw(self, token_id: int) -> bytes:
        """The token's own bytes: a token holding part of a UTF-8 character decodes to U+FFFD,
        whose UTF-8 (EF BF BD) is not what the model produced; OpenAI's `bytes` are the real ones."""
        raw = self._raw.get(token_id)
        if raw is None:
            raw = self._raw[token_id] = self._token_bytes(token_id)
        return raw

    def _token_bytes(self, token_id: int) -> bytes:
        convert = getattr(self.tokenizer, "convert_ids_to_tokens", None)
        piece = convert(token_id) if convert is not None and token_id not in self._added else None
        if isinstance(piece, str) and piece:  # "": an id the vocabulary lacks
            if self._byte_level and all(c in BYTE_DECODER for c in piece):
                return bytes(BYTE_DECODER[c] for c in piece)
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece byte fallback
                try:
                    return bytes([int(piece[3:5], 16)])
                except ValueError:
                    pass
        return self.text(token_id).encode(errors="surrogatepass")


def completion_logprobs(entries: list[frontend_pb2.GeneratedTokenLogprobs], token_ids: list[int],
                        tokens: TokenTexts, offset: int = 0) -> dict[str, Any]:
    """OpenAI's legacy completions logprobs; `offset`: where this piece starts in the choice's text."""
    texts = [tokens.text(t) for t in token_ids]
    offsets = []
    for t in texts:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": texts, "token_logprobs": [_lp(e.logprob) for e in entries],
            "top_logprobs": [{tokens.text(t.token_id): _lp(t.logprob) for t in e.top} for e in entries],
            "text_offset": offsets}


def chat_logprobs(entries: list[frontend_pb2.GeneratedTokenLogprobs], token_ids: list[int],
                  tokens: TokenTexts) -> dict[str, Any]:
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": tokens.text(token_id), "logprob": _lp(logprob), "bytes": list(tokens.raw(token_id))}

    return {"content": [{**item(t, e.logprob), "top_logprobs": [item(x.token_id, x.logprob) for x in e.top]}
                        for t, e in zip(token_ids, entries)]}


def check_not_aborted(out: frontend_pb2.GenerateResponse) -> None:
    """An output the server aborted (a failure or a deadline on its side) ends the request with
    an error: OpenAI has no finish reason for it, and its text is not a complete answer."""
    if out.finish_reason == common_pb2.FINISH_REASON_ABORT:
        raise RequestError(Code.UNAVAILABLE, "the server aborted the request before it finished; try again")


def usage(choices: list[Choice], n: int) -> dict[str, Any]:
    """Prompt tokens count once per prompt (its n copies share it), completion tokens per choice."""
    prompt = sum(c.usage.prompt_tokens for c in choices[::n] if c.usage)
    cached = sum(c.usage.cached_prompt_tokens for c in choices[::n] if c.usage)
    completion = sum(c.usage.completion_tokens for c in choices if c.usage)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def finish_reason(code: int) -> str | None:
    return FINISH_REASONS.get(code)


def completion_body(request_id: str, created: int, model: str, choices: list[Choice], n: int, want_logprobs: bool,
                    tokens: TokenTexts) -> dict[str, Any]:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": i, "text": c.text, "finish_reason": finish_reason(c.finish_reason),
                         "logprobs": completion_logprobs(c.logprobs, c.token_ids, tokens) if want_logprobs
                         else None} for i, c in enumerate(choices)],
            "usage": usage(choices, n)}


def chat_body(request_id: str, created: int, model: str, choices: list[Choice], n: int, want_logprobs: bool,
              tokens: TokenTexts) -> dict[str, Any]:
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": i, "message": {"role": "assistant", "content": c.text},
                         "finish_reason": finish_reason(c.finish_reason),
                         "logprobs": chat_logprobs(c.logprobs, c.token_ids, tokens) if want_logprobs else None}
                        for i, c in enumerate(choices)],
            "usage": usage(choices, n)}


ErrorType = Literal["invalid_request_error", "authentication_error", "not_found_error", "rate_limit_error",
                    "service_unavailable_error", "timeout_error", "internal_error"]
HTTP_STATUS: dict[Code, tuple[int, ErrorType]] = {
    Code.INVALID_ARGUMENT: (400, "invalid_request_error"),
    Code.UNAUTHENTICATED: (401, "authentication_error"),
    Code.NOT_FOUND: (404, "not_found_error"),
    Code.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    Code.UNAVAILABLE: (503, "service_unavailable_error"),
    Code.DEADLINE_EXCEEDED: (504, "timeout_error"),
}


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def param_of(message: str) -> str | None:
    """The field a validation message names: its text before the first ':' or ' ', without
    the gRPC API's `sampling.` prefix (e.g. 'sampling.top_p must be ...' -> 'top_p')."""
    head = message.split(":", 1)[0].split(" ", 1)[0]
    if not head or not all(c.isalnum() or c in "._[]" for c in head):
        return None
    return head.removeprefix("sampling.")


def param_aliases(body: CompletionRequest | ChatCompletionRequest) -> dict[str, str]:
    if isinstance(body, CompletionRequest):
        return {"token_ids": "prompt", "input": "prompt"}
    aliases = {"prompt": "messages", "chat": "messages", "input": "messages"}
    if body.max_completion_tokens is not None:
        aliases["max_tokens"] = "max_completion_tokens"
    return aliases


def request_error_body(exc: RequestError, aliases: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    """`aliases`: the gRPC API's field names as this HTTP request spelled them (token_ids -> prompt)."""
    status, error_type = HTTP_STATUS.get(exc.code, (500, "internal_error"))
    code = {Code.UNAUTHENTICATED: "invalid_api_key", Code.NOT_FOUND: "model_not_found"}.get(exc.code)
    param = param_of(exc.message) if status in (400, 404) else None
    param = (aliases or {}).get(param, param)
    return status, error_body(exc.message, error_type, param, code)
