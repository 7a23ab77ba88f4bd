"""OpenAI's response bodies, built from the frontend core's outputs (GenerationOutput), and the
token texts they name. Pure functions: no I/O."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from vmesh.services.common.generation import GenerationOutput, GenerationRequest
from vmesh.services.common.output_accumulator import OutputAccumulator
from vmesh.services.common.types import FinishReason, TokenLogprobs, Usage
from vmesh.services.frontend.tool_parsers import ToolReader, make_parser, parse_text

# JSON has no -inf: a logprob that underflowed is sent as this, as vLLM does.
MIN_LOGPROB = -9999.0
# Only OpenAI's values: "abort" (which vLLM passes through) breaks clients that switch on the
# enum, and an aborted request did not complete, so it is reported as an error instead.
# The enum's values are OpenAI's names.
OPENAI_FINISH_REASONS = frozenset({FinishReason.STOP, FinishReason.LENGTH})


@dataclass
class Choice(OutputAccumulator[TokenLogprobs]):
    """What one choice has received so far (the HTTP API asks for delta outputs)."""

    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    prompt_token_ids: list[int] = field(default_factory=list)  # with prompt logprobs, asked for
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)

    def add(self, out: GenerationOutput) -> None:
        self.extend(out.text, out.token_ids, out.logprobs)
        self.finish_reason = out.finish_reason or self.finish_reason
        if out.prompt_token_ids:
            self.prompt_token_ids, self.prompt_logprobs = out.prompt_token_ids, out.prompt_logprobs
        if out.usage is not None:
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

    def is_special(self, token_id: int) -> bool: ...


def word_mark(backend: Any) -> str:
    """The character a SentencePiece-style vocabulary writes spaces as ("▁"), read from the
    tokenizer's decoder (Metaspace, or a Replace of it by a space); "" for other vocabularies."""
    try:  # the decoder's own JSON: serializing the whole tokenizer takes a second for a large vocabulary
        decoder = json.loads(backend.decoder.__getstate__()) or {}
    except (AttributeError, TypeError, ValueError):
        return ""
    for d in decoder.get("decoders") or [decoder]:
        if d.get("type") == "Metaspace":
            return str(d.get("replacement") or "")
        pattern = d.get("pattern") or {}
        if d.get("type") == "Replace" and d.get("content") == " " and isinstance(pattern.get("String"), str):
            return pattern["String"]
    return ""


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
        self._word_mark = word_mark(backend)
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._added = set(added)
        self._special = {i for i, token in added.items() if getattr(token, "special", False)}

    def text(self, token_id: int) -> str:
        text = self._text.get(token_id)
        if text is None:
            text = self._text[token_id] = self.tokenizer.decode([token_id])
        return text

    def is_special(self, token_id: int) -> bool:
        """A special token: decoding leaves it out of the text unless told to keep it."""
        return token_id in self._special

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
            if self._word_mark and self._word_mark in piece:  # decoding a lone token drops its leading space
                return piece.replace(self._word_mark, " ").encode()
        return self.text(token_id).encode(errors="surrogatepass")


def completion_token(tokens: TokenTexts, token_id: int) -> str:
    """A token as legacy completions' logprobs name it: its text, or, where its bytes are part of
    a UTF-8 character (a byte-level or byte-fallback piece), `bytes:` and their escapes, as
    OpenAI writes them ("bytes:\\xf0\\x9f"): U+FFFD for each would make distinct tokens one key."""
    raw = tokens.raw(token_id)
    try:
        return raw.decode("utf-8")  # its own text, leading space included (what text_offset counts)
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _continues_a_character(byte: int) -> bool:
    return 0x80 <= byte < 0xC0  # a UTF-8 continuation byte


def text_offsets(token_ids: Sequence[int], tokens: TokenTexts, characters: int = 0,
                 skip_special: bool = True) -> tuple[list[int], int]:
    """Each token's offset in the text its bytes decode to (characters, as Python counts them,
    from `characters`: where the first token's bytes start), and the offset after the last. A
    token starting inside a character (the rest of an emoji) is at that character's offset, so
    offsets never decrease and each names where its token's text starts. `skip_special`: the
    text leaves special tokens out (decoding's default), so they take no room."""
    offsets = []
    for t in token_ids:
        raw = b"" if skip_special and tokens.is_special(t) else tokens.raw(t)
        offsets.append(max(characters - bool(raw and _continues_a_character(raw[0])), 0))
        characters += sum(not _continues_a_character(b) for b in raw)
    return offsets, characters


def completion_logprobs(entries: list[TokenLogprobs], token_ids: list[int], tokens: TokenTexts,
                        offsets: list[int] | None = None, skip_special: bool = True) -> dict[str, Any]:
    """OpenAI's legacy completions logprobs; `offsets`: the tokens' text_offset (text_offsets,
    from the choice's start; None: from 0)."""
    if offsets is None:
        offsets = text_offsets(token_ids, tokens, skip_special=skip_special)[0]
    return {"tokens": [completion_token(tokens, t) for t in token_ids],
            "token_logprobs": [_lp(e.logprob) for e in entries],
            "top_logprobs": [{completion_token(tokens, t): _lp(lp) for t, lp in zip(e.top_token_ids, e.top_logprobs)}
                             for e in entries],
            "text_offset": offsets}


def prompt_logprobs_body(choice: Choice, tokens: TokenTexts) -> list[dict[str, Any] | None]:
    """vLLM's prompt_logprobs: null for the first prompt token, then for each token a map from token
    id to its logprob, rank and text, holding the token itself and its position's top N."""
    def entry(token_id: int, logprob: float, rank: int) -> dict[str, Any]:
        return {"logprob": _lp(logprob), "rank": rank, "decoded_token": tokens.text(token_id)}

    body: list[dict[str, Any] | None] = [None] if choice.prompt_token_ids else []
    for token_id, row in zip(choice.prompt_token_ids[1:], choice.prompt_logprobs):
        top = {str(t): entry(t, lp, i + 1) for i, (t, lp) in enumerate(zip(row.top_token_ids, row.top_logprobs))}
        body.append({**top, str(token_id): entry(token_id, row.logprob, row.rank)})
    return body


@dataclass(frozen=True)
class Echo:
    """A completions request's `echo`: each choice's text starts with its prompt's (`prompts`, by
    prompt), and with logprobs its logprobs start with the prompt's tokens. `without_generation`:
    max_tokens 0, served as one token that the reply leaves out."""
    prompts: list[str]
    without_generation: bool = False


def echo_of(requests: list[GenerationRequest], without_generation: bool, tokens: TokenTable) -> Echo:
    """The echo of completions' requests: a text prompt's own text, token ids decoded."""
    return Echo([r.prompt if isinstance(r.prompt, str) else tokens.tokenizer.decode(list(r.prompt))
                 if isinstance(r.prompt, Sequence) else "" for r in requests], without_generation)


def echoed(choice: Choice, prompt: str, echo: Echo) -> Choice:
    """The choice as an echo reply shows it: its prompt's text first, and nothing generated
    after it where none was asked for."""
    if echo.without_generation:
        usage = replace(choice.usage, completion_tokens=0) if choice.usage else None
        choice = replace(choice, text="", token_ids=[], logprobs=[], usage=usage)
    return replace(choice, text=prompt + choice.text)


def echo_logprobs(choice: Choice, prompt: str, tokens: TokenTexts, skip_special: bool = True) -> dict[str, Any]:
    """OpenAI's completions logprobs of an echo: the prompt's tokens (the first one's logprob and
    top entries null: nothing scores it), then the generated ones, whose offsets start after the
    prompt's text. The prompt's offsets are counted back from its end: a text prompt's tokens
    may begin with one the tokenizer added (BOS), which the echoed text does not hold."""
    prompt_offsets, end = text_offsets(choice.prompt_token_ids, tokens, skip_special=False)
    prompt_offsets = [max(o + len(prompt) - end, 0) for o in prompt_offsets]
    scored = completion_logprobs(choice.prompt_logprobs, choice.prompt_token_ids[1:], tokens, prompt_offsets[1:])
    first = choice.prompt_token_ids[:1]
    generated = completion_logprobs(choice.logprobs, choice.token_ids, tokens,
                                    text_offsets(choice.token_ids, tokens, len(prompt), skip_special)[0])
    return {"tokens": [completion_token(tokens, t) for t in first] + scored["tokens"] + generated["tokens"],
            "token_logprobs": [None] * len(first) + scored["token_logprobs"] + generated["token_logprobs"],
            "top_logprobs": [None] * len(first) + scored["top_logprobs"] + generated["top_logprobs"],
            "text_offset": prompt_offsets[:1] + scored["text_offset"] + generated["text_offset"]}


def chat_logprobs(entries: list[TokenLogprobs], token_ids: list[int],
                  tokens: TokenTexts) -> dict[str, Any]:
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": tokens.text(token_id), "logprob": _lp(logprob), "bytes": list(tokens.raw(token_id))}

    return {"content": [{**item(t, e.logprob), "top_logprobs": [item(x, lp) for x, lp in zip(e.top_token_ids,
                                                                                             e.top_logprobs)]}
                        for t, e in zip(token_ids, entries)]}


def usage(choices: list[Choice], n: int) -> dict[str, Any]:
    """Prompt tokens count once per prompt (its n copies share it), completion tokens per choice."""
    prompt = sum(c.usage.prompt_tokens for c in choices[::n] if c.usage)
    cached = sum(c.usage.cached_prompt_tokens for c in choices[::n] if c.usage)
    completion = sum(c.usage.completion_tokens for c in choices if c.usage)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def finish_reason(reason: FinishReason | None, calls_reason: str | None = None) -> str | None:
    """`calls_reason`: where the choice's text held tool calls, what a choice that stopped then
    reports (calls_finish_reason)."""
    if reason is FinishReason.STOP and calls_reason:
        return calls_reason
    return reason.value if reason in OPENAI_FINISH_REASONS else None


def legacy_calls(tools: ToolReader | None) -> bool:
    """The request named the legacy `functions`: its calls are answered in their shape."""
    return tools is not None and tools.plan.legacy


def calls_finish_reason(tools: ToolReader | None) -> str | None:
    """The finish_reason of a choice that made calls and stopped: "tool_calls" ("function_call"
    for the legacy `functions`); None (so "stop") where the request named the function to call,
    as OpenAI and vLLM answer it."""
    if tools is None or tools.plan.choice not in ("auto", "required"):
        return None
    return "function_call" if tools.plan.legacy else "tool_calls"


def chat_message(choice: Choice, tools: ToolReader | None) -> tuple[dict[str, Any], bool]:
    """The assistant's message for a choice's whole text, and whether it made tool calls: the
    text read by the same parser the streamed deltas go through (tool_parsers)."""
    parser = make_parser(tools)
    if parser is None:
        return {"role": "assistant", "content": choice.text}, False
    content, calls = parse_text(parser, choice.text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls and legacy_calls(tools):  # one call at most (the plan is not parallel)
        message["function_call"] = calls[0]["function"]
    elif calls:
        message["tool_calls"] = calls
    return message, bool(calls)


def completion_body(request_id: str, created: int, model: str, choices: list[Choice], n: int, want_logprobs: bool,
                    tokens: TokenTexts, echo: Echo | None = None, want_prompt_logprobs: bool = False,
                    skip_special: bool = True) -> dict[str, Any]:
    """`want_prompt_logprobs`: vLLM's prompt_logprobs field, in each choice; `skip_special`: the
    requests' skip_special_tokens (the text holds no special tokens)."""
    rendered = []
    for i, c in enumerate(choices):
        prompt = echo.prompts[i // n] if echo is not None else ""
        if echo is not None:
            c = choices[i] = echoed(c, prompt, echo)
        logprobs = None
        if want_logprobs:
            logprobs = echo_logprobs(c, prompt, tokens, skip_special) if echo is not None else completion_logprobs(
                c.logprobs, c.token_ids, tokens, skip_special=skip_special)
        rendered.append({"index": i, "text": c.text, "finish_reason": finish_reason(c.finish_reason),
                         "logprobs": logprobs,
                         **({"prompt_logprobs": prompt_logprobs_body(c, tokens)} if want_prompt_logprobs else {})})
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": rendered, "usage": usage(choices, n)}


def chat_body(request_id: str, created: int, model: str, choices: list[Choice], n: int, want_logprobs: bool,
              tokens: TokenTexts, tools: ToolReader | None = None, want_prompt_logprobs: bool = False
              ) -> dict[str, Any]:
    """`want_prompt_logprobs`: vLLM's prompt_logprobs, once for the response (the choices share the prompt)."""
    rendered = []
    for i, c in enumerate(choices):
        message, made_calls = chat_message(c, tools)
        rendered.append({"index": i, "message": message,
                         "finish_reason": finish_reason(c.finish_reason,
                                                        calls_finish_reason(tools) if made_calls else None),
                         "logprobs": chat_logprobs(c.logprobs, c.token_ids, tokens) if want_logprobs else None})
    body = {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": rendered, "usage": usage(choices, n)}
    if want_prompt_logprobs:
        body["prompt_logprobs"] = prompt_logprobs_body(choices[0], tokens) if choices else None
    return body
