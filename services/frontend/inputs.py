"""A request's input (text, a chat, or token ids) as the frontend measures and tokenizes it."""

from __future__ import annotations

from typing import Any

from vmesh.services.common.admission import InvalidRequest
from vmesh.services.common.tokenizer import encode_chat


def prompt_bytes(which: str | None, message: Any) -> int:
    if which == "text":
        return len(message.text.encode())
    if which == "chat":
        return sum(len(m.content.encode()) + len(m.role.encode()) for m in message.chat.messages)
    return 0


def encode_input(tokenizer: Any, which: str | None, message: Any) -> list[int]:
    if which == "text":
        return tokenizer.encode(message.text) if message.text else []
    if which == "chat":
        messages = [{"role": m.role, "content": m.content} for m in message.chat.messages]
        if not messages:
            raise InvalidRequest("chat", "no messages")
        try:
            return encode_chat(tokenizer, messages)
        except Exception as exc:  # the template rejects the conversation (roles, order)
            raise InvalidRequest("chat", str(exc)) from exc
    if which == "token_ids":
        return list(message.token_ids.ids)
    raise InvalidRequest("input", "one of text, chat or token_ids is required")
