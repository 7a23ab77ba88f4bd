"""A request's cost is bounded before it is paid: an HTTP request's prompts share one byte budget
and one token budget (times n), checked before tokenizing, and a text or a chat whose head alone
is longer than the context is refused without tokenizing the rest. No network."""
from __future__ import annotations

import asyncio
from typing import Any

import grpc
import httpx
import pytest

from tests.support.fake_scheduler import FakeScheduler
from tests.support.frontends import serving_frontend
from tests.unit.test_frontend_requests import RefusingTokenizer
from tests.unit.test_openai_http import CharTokenizer
from vmesh.services.common.generation import Chat, ChatMessage
from vmesh.services.common.tokenizer import encode_chat
from vmesh.services.common.types import ModelLimits
from vmesh.services.frontend.errors import RequestError
from vmesh.services.frontend.http_server import build_app
from vmesh.services.frontend.inputs import HEAD_CHARS_PER_TOKEN

CONTEXT = 8192


class Recording:
    """A tokenizer that records the length of every text it is asked to encode, a chat's rendered
    prompt included when the chat template tokenizes it."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.lengths: list[int] = []

    def __getattr__(self, name: str) -> Any:  # its chat template, special tokens, ...
        return getattr(self.tokenizer, name)

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        self.lengths.append(len(text))
        return self.tokenizer.encode(text, **kwargs)

    def apply_chat_template(self, messages: list[dict], **kwargs: Any) -> Any:
        if kwargs.get("tokenize", True):
            self.lengths.append(len(self.tokenizer.apply_chat_template(messages, **{**kwargs, "tokenize": False})))
        return self.tokenizer.apply_chat_template(messages, **kwargs)


def test_a_text_whose_head_overflows_the_context_is_refused_without_tokenizing_the_rest(embedded_tokenizer):
    tokenizer = Recording(embedded_tokenizer)
    prompt = "y " * (1 << 19)  # 1 MiB: within the prompt byte limit, about 524,000 tokens

    async def main():
        f, _ = await serving_frontend(tokenizer, FakeScheduler(ModelLimits("m", CONTEXT, 49152)))
        with pytest.raises(RequestError) as refused:
            await f.encode(prompt)
        fits = await f.encode("y " * 100)  # a text that fits is tokenized whole, as before
        await f.schedulers.close()
        return refused.value, fits

    refused, fits = asyncio.run(main())
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT and refused.field == "prompt"
    assert "the context holds 8192" in refused.message
    assert fits == embedded_tokenizer.encode("y " * 100)
    assert max(tokenizer.lengths) == (CONTEXT + 1) * HEAD_CHARS_PER_TOKEN < len(prompt) // 8


def test_a_chat_whose_head_overflows_the_context_costs_no_more_than_such_a_text(embedded_tokenizer):
    """Its rendered prompt's head is tokenized, as a text's is, never the whole of it."""
    tokenizer = Recording(embedded_tokenizer)
    long_chat = Chat([ChatMessage("system", "Be brief."), ChatMessage("user", "y " * ((1 << 19) - 64))])
    short = [{"role": "user", "content": "y " * 100}]

    async def main():
        f, _ = await serving_frontend(tokenizer, FakeScheduler(ModelLimits("m", CONTEXT, 49152)))
        with pytest.raises(RequestError) as refused:
            await f.encode(long_chat)
        fits = await f.encode(Chat([ChatMessage(**m) for m in short]))  # tokenized whole, as before
        await f.schedulers.close()
        return refused.value, fits

    refused, fits = asyncio.run(main())
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT and refused.field == "prompt"
    assert "the context holds 8192" in refused.message
    assert fits == encode_chat(embedded_tokenizer, short)
    assert max(tokenizer.lengths) == (CONTEXT + 1) * HEAD_CHARS_PER_TOKEN


def test_a_long_chat_within_the_context_gets_the_ids_the_template_gives(embedded_tokenizer):
    """A chat of more characters than 8 per context token (a run of spaces: ~60 characters a token)
    has its head checked first, then is tokenized whole: the ids the template gives."""
    tokenizer = Recording(embedded_tokenizer)
    messages = [{"role": "user", "content": "Where does this end?" + " " * 80_000 + "Here."}]

    async def main():
        f, _ = await serving_frontend(tokenizer, FakeScheduler(ModelLimits("m", CONTEXT, 49152)))
        try:
            return await f.encode(Chat([ChatMessage(**m) for m in messages]))
        finally:
            await f.schedulers.close()

    ids = asyncio.run(main())
    assert ids == encode_chat(embedded_tokenizer, messages) and len(ids) < CONTEXT
    assert (CONTEXT + 1) * HEAD_CHARS_PER_TOKEN in tokenizer.lengths  # its head was checked first


async def _post(tokenizer: Any, body: dict, **settings: Any) -> httpx.Response:
    f, _ = await serving_frontend(tokenizer, FakeScheduler(ModelLimits("m", CONTEXT, 1 << 17)), **settings)
    transport = httpx.ASGITransport(app=build_app(f, None))
    async with httpx.AsyncClient(transport=transport, base_url="http://frontend") as http:
        response = await http.post("/v1/completions", json=body)
    await f.schedulers.close()
    return response


@pytest.mark.parametrize(("tokenizer", "body", "settings", "message"), [
    (RefusingTokenizer(), {"prompt": ["x" * 600, "y" * 600]}, dict(max_prompt_bytes=600, max_request_bytes=1000),
     "prompt: 1200 bytes of text across the request's prompts; at most 1000 are accepted"),
    (RefusingTokenizer(), {"prompt": [[1] * 100] * 4, "n": 16}, dict(max_request_tokens=1000),
     "prompt: 400 prompt tokens x n=16; at most 1000 per request"),
    (CharTokenizer(), {"prompt": ["a" * 300, "b" * 300], "n": 2, "max_tokens": 1}, dict(max_request_tokens=1000),
     "prompt: 600 prompt tokens x n=2; at most 1000 per request"),
], ids=["bytes-across-prompts", "token-ids-times-n", "tokenized-text-times-n"])
def test_an_http_request_over_its_budget_is_refused_before_it_costs(tokenizer, body, settings, message):
    response = asyncio.run(_post(tokenizer, body, **settings))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"] == message and response.json()["error"]["param"] == "prompt"
