"""vLLM's utility endpoints: POST /tokenize (a prompt, or chat messages through the model's chat
template), POST /detokenize and GET /version, with the same fields and answers as vLLM's, so that
tools built for vLLM (benchmark clients, evaluation harnesses, prompt budgeting) work unchanged.
Tokenizing runs on the frontend's tokenizer threads, under the same byte limit as a generation's prompt."""

from __future__ import annotations

import asyncio
import importlib.metadata
from typing import Any

from fastapi import FastAPI
from pydantic import Field

from vmesh.services.common.admission import InvalidRequest
from vmesh.services.common.generation import Chat
from vmesh.services.common.tokenizer import encode_chat
from vmesh.services.frontend import openai_protocol as oai
from vmesh.services.frontend import tool_calls
from vmesh.services.frontend.core import FrontendCore
from vmesh.services.frontend.errors import RequestError
from vmesh.services.frontend.inputs import chat_messages, prompt_bytes

VERSION = importlib.metadata.version("vmesh")


class TokenizeRequest(oai.RequestBody):
    """vLLM's two request shapes in one: `prompt` (a completion's text) or `messages` (a chat)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[oai.ChatMessage] | None = None
    add_special_tokens: bool | None = Field(None, description="default: true for a prompt, false for messages "
                                                              "(the chat template writes its own)")
    add_generation_prompt: bool = Field(True, description="messages: end with the assistant's turn opening")
    continue_final_message: bool = Field(False, description="not supported: refused when true")
    tools: list[Any] | None = Field(None, description="messages: tools for the chat template")
    chat_template: str | None = Field(None, description="not supported: start the server with --chat-template")
    return_token_strs: bool = Field(False, description="also each token's piece of the vocabulary")


class DetokenizeRequest(oai.RequestBody):
    model: str | None = None
    tokens: list[int]


def _input(body: TokenizeRequest) -> tuple[str | Chat, list[dict[str, Any]] | None]:
    """The text or the chat to tokenize, checked, and the chat's tools."""
    if (body.prompt is None) == (body.messages is None):
        raise oai.invalid("prompt", "give exactly one of prompt and messages")
    if body.prompt is not None:
        return oai.utf8_text("prompt", body.prompt), None
    if body.continue_final_message:
        raise oai.invalid("continue_final_message", "not supported by vmesh")
    if body.chat_template is not None:
        raise oai.invalid("chat_template", "not supported per request by vmesh (start it with --chat-template)")
    messages = body.messages or []
    if not messages:
        raise oai.invalid("messages", "at least one message is required")
    plan = tool_calls.tool_plan(body.tools, None, None)
    return Chat([oai.chat_message(i, m) for i, m in enumerate(messages)]), plan.prompt_tools or None


def _tokenize(tokenizer: Any, prompt: str | Chat, tools: list[dict[str, Any]] | None, body: TokenizeRequest
              ) -> list[int]:
    if isinstance(prompt, str):
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        return list(tokenizer.encode(prompt, add_special_tokens=add_special)) if prompt else []
    try:
        return encode_chat(tokenizer, chat_messages(prompt), tools, body.add_generation_prompt,
                           bool(body.add_special_tokens))
    except Exception as exc:  # the template rejects the conversation (roles, order)
        raise oai.invalid("messages", str(exc)) from exc


async def tokenize(frontend: FrontendCore, body: TokenizeRequest) -> dict[str, Any]:
    frontend.ready()
    limits = frontend.loaded_limits()
    oai.check_model(body.model, limits.name)
    prompt, tools = _input(body)
    size = prompt_bytes(prompt)
    if size > frontend.settings.max_prompt_bytes:
        raise oai.invalid("prompt" if isinstance(prompt, str) else "messages",
                          f"{size} bytes of text; at most {frontend.settings.max_prompt_bytes} are accepted")
    tokenizer = frontend.tokenizer
    ids = await asyncio.get_running_loop().run_in_executor(frontend.tokenizer_pool, _tokenize, tokenizer, prompt,
                                                           tools, body)
    answer: dict[str, Any] = {"count": len(ids), "max_model_len": limits.max_model_len, "tokens": ids,
                              "token_strs": None}
    if body.return_token_strs:
        answer["token_strs"] = list(tokenizer.convert_ids_to_tokens(ids))
    return answer


async def detokenize(frontend: FrontendCore, body: DetokenizeRequest) -> dict[str, Any]:
    frontend.ready()
    limits = frontend.loaded_limits()
    oai.check_model(body.model, limits.name)
    bad = next((i for i, t in enumerate(body.tokens) if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise RequestError.invalid(InvalidRequest(f"tokens[{bad}]", f"{body.tokens[bad]} is outside the vocabulary "
                                                                     f"[0, {limits.vocab_size})"))
    text = await asyncio.get_running_loop().run_in_executor(frontend.tokenizer_pool, frontend.tokenizer.decode,
                                                            body.tokens)
    return {"prompt": text}


def add_routes(app: FastAPI, frontend: FrontendCore) -> None:
    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest) -> dict[str, Any]:
        return await tokenize(frontend, body)

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest) -> dict[str, Any]:
        return await detokenize(frontend, body)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": VERSION}
