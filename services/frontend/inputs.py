"""A request's input (text, a chat, or token ids) as the frontend measures and tokenizes it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from vmesh.services.common.admission import InvalidRequest
from vmesh.services.common.generation import Chat, ChatMessage, Prompt
from vmesh.services.common.tokenizer import encode_chat, render_chat

# A text (or a chat's rendered prompt) of more characters than this many per token the context
# holds is first tokenized in part, its head that long: most prompts too long for the context are
# refused on their head alone, without paying for the rest, whose length the client chose.
HEAD_CHARS_PER_TOKEN = 8
# Tokens wholly inside the head are the whole text's too; those around the cut may differ.
CUT_SLACK_TOKENS = 16


def prompt_bytes(prompt: Prompt | None) -> int:
    if isinstance(prompt, str):
        return len(prompt.encode())
    if isinstance(prompt, Chat):
        calls = sum(len(c.name.encode()) + len(c.arguments.encode()) for m in prompt.messages for c in m.tool_calls)
        return calls + len(prompt.tools.encode()) + sum(
            len(m.content.encode()) + len(m.role.encode()) for m in prompt.messages)
    return 0


# The roles a chat message may have, on either API, and the one the chat template gets: OpenAI's
# "developer" is a system message, its legacy "function" a tool's result.
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool",
              "function": "tool"}
ROLES_ACCEPTED = "system, developer, user, assistant, tool"


def chat_role(field: str, message: ChatMessage) -> str:
    """The template role of `message` (`field`: its name in the request), once its role and the
    fields that role requires are as the HTTP API has them too."""
    role = CHAT_ROLES.get(message.role)
    if role is None:
        raise InvalidRequest(f"{field}.role", f"{message.role!r} is not supported ({ROLES_ACCEPTED})")
    if message.tool_calls and role != "assistant":
        raise InvalidRequest(f"{field}.tool_calls", "only assistant messages make tool calls")
    for j, call in enumerate(message.tool_calls):
        if not call.name:
            raise InvalidRequest(f"{field}.tool_calls[{j}].name", "required")
    if role == "tool" and not message.tool_call_id:
        raise InvalidRequest(f"{field}.tool_call_id", "required")
    return role


def check_request_tokens(tokens: int, n: int, max_request_tokens: int) -> None:
    if tokens * n > max_request_tokens:
        raise InvalidRequest("prompt", f"{tokens} prompt tokens x n={n}; at most {max_request_tokens} per request")


def check_request_budget(prompts: Sequence[Prompt | None], n: int, max_request_bytes: int,
                         max_request_tokens: int) -> None:
    """Before anything is tokenized: one request's prompts together (an HTTP request may hold
    many, each sent n times) within its byte budget, and its token ids times n within its token budget."""
    size = sum(prompt_bytes(p) for p in prompts)
    if size > max_request_bytes:
        raise InvalidRequest("prompt", f"{size} bytes of text across the request's prompts; at most "
                                       f"{max_request_bytes} are accepted")
    check_request_tokens(sum(len(p) for p in prompts if p is not None and not isinstance(p, (str, Chat))), n,
                         max_request_tokens)


def _head_chars(context: int) -> int:
    return (context + 1) * HEAD_CHARS_PER_TOKEN


def _check_head(tokenizer: Any, text: str, context: int) -> None:
    head_chars = _head_chars(context)
    if len(text) <= head_chars:
        return
    head = len(tokenizer.encode(text[:head_chars]))
    if head - CUT_SLACK_TOKENS >= context:
        raise InvalidRequest("prompt", f"over {head - CUT_SLACK_TOKENS} tokens in its first {head_chars} characters "
                                       f"alone; the context holds {context}, so the prompt must be shorter")


def chat_messages(chat: Chat) -> list[dict[str, Any]]:
    """A chat as the chat template takes it (OpenAI's shape: an assistant's `tool_calls`, a tool
    result's `tool_call_id`), checked as either API's chat is."""
    messages = []
    for i, m in enumerate(chat.messages):
        message: dict[str, Any] = {"role": chat_role(f"chat.messages[{i}]", m), "content": m.content}
        if m.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in m.tool_calls]
            message["content"] = m.content or None
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        messages.append(message)
    return messages


def _encode_chat(tokenizer: Any, chat: Chat, context: int | None) -> list[int]:
    messages = chat_messages(chat)
    if not messages:
        raise InvalidRequest("chat", "no messages")
    try:
        tools = json.loads(chat.tools) if chat.tools else None
    except ValueError as exc:
        raise InvalidRequest("chat.tools", f"not JSON ({exc})") from exc
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise InvalidRequest("chat.tools", "must be a JSON array of tool objects")
    try:
        if context is not None and prompt_bytes(chat) > _head_chars(context):
            # Rendering is cheap beside tokenizing: the rendered prompt's head is checked as a
            # text's is, and a chat too long for the context costs what such a text costs.
            _check_head(tokenizer, render_chat(tokenizer, messages, tools), context)
        return encode_chat(tokenizer, messages, tools)
    except InvalidRequest:
        raise
    except Exception as exc:  # the template rejects the conversation (roles, order)
        raise InvalidRequest("chat", str(exc)) from exc


def encode_input(tokenizer: Any, prompt: Prompt | None, context: int | None = None) -> list[int]:
    """`context`: the model's context length, when known: a text, or a chat's rendered prompt,
    whose head alone is longer is refused without tokenizing the rest."""
    if prompt is None:
        raise InvalidRequest("input", "one of text, chat or token_ids is required")
    if isinstance(prompt, str):
        if context is not None:
            _check_head(tokenizer, prompt, context)
        return tokenizer.encode(prompt) if prompt else []
    if isinstance(prompt, Chat):
        return _encode_chat(tokenizer, prompt, context)
    return list(prompt)
