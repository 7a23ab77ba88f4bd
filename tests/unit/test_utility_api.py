"""vLLM's /tokenize, /detokenize and /version on the frontend's HTTP app, over the embedded model's
tokenizer as the frontend loads it: ids equal to transformers' tokenizer for prompts and chats
(with and without special tokens and the generation prompt), the answer's shape, and the errors."""
from __future__ import annotations

import asyncio
import importlib.metadata
from typing import Any

import httpx
import pytest

from tests.support.frontends import make_frontend
from vmesh.services.common.tokenizer import load_chat_tokenizer
from vmesh.services.common.types import ModelLimits
from vmesh.services.frontend.http_server import build_app

NAME = "smol"
LIMITS = ModelLimits(NAME, max_model_len=2048, vocab_size=49152)
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime number."}]


@pytest.fixture(scope="module")
def chat_tokenizer(embedded_model_dir: Any) -> Any:
    return load_chat_tokenizer(embedded_model_dir)


def request(tokenizer: Any, path: str, body: dict[str, Any] | None = None, **settings: Any) -> httpx.Response:
    """POST `body` to `path` (GET without one) on a frontend's app."""
    async def main() -> httpx.Response:
        app = build_app(make_frontend(tokenizer, LIMITS, **settings), None)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://vmesh") as client:
            return await (client.get(path) if body is None else client.post(path, json=body))

    return asyncio.run(main())


@pytest.mark.parametrize("add_special_tokens", [None, True, False])
def test_tokenize_a_prompt_as_transformers_does(chat_tokenizer: Any, embedded_tokenizer: Any,
                                                      add_special_tokens: bool | None) -> None:
    text = "The capital of France is Paris. <|im_start|>"
    body: dict[str, Any] = {"model": NAME, "prompt": text, "return_token_strs": True}
    if add_special_tokens is not None:
        body["add_special_tokens"] = add_special_tokens
    reply = request(chat_tokenizer, "/tokenize", body)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    expected = embedded_tokenizer.encode(text, add_special_tokens=add_special_tokens is not False)
    assert answer == {"count": len(expected), "max_model_len": 2048, "tokens": expected,
                      "token_strs": embedded_tokenizer.convert_ids_to_tokens(expected)}


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tokenize_messages_through_the_chat_template(chat_tokenizer: Any, embedded_tokenizer: Any,
                                                           add_generation_prompt: bool) -> None:
    reply = request(chat_tokenizer, "/tokenize", {"messages": CHAT, "add_generation_prompt": add_generation_prompt})
    assert reply.status_code == 200, reply.text
    expected = embedded_tokenizer.apply_chat_template(CHAT, add_generation_prompt=add_generation_prompt,
                                                      tokenize=True, return_dict=False)
    assert reply.json()["tokens"] == list(expected)
    assert reply.json()["token_strs"] is None


def test_the_frontend_generates_from_the_ids_tokenize_reports(chat_tokenizer: Any) -> None:
    """/tokenize on messages gives the very prompt a chat completion is generated from."""
    from vmesh.services.common.generation import Chat, ChatMessage
    from vmesh.services.frontend.inputs import encode_input

    reply = request(chat_tokenizer, "/tokenize", {"messages": CHAT})
    chat = Chat([ChatMessage(m["role"], m["content"]) for m in CHAT])
    assert reply.json()["tokens"] == encode_input(chat_tokenizer, chat)


def test_detokenize_round_trips(chat_tokenizer: Any, embedded_tokenizer: Any) -> None:
    ids = embedded_tokenizer.encode("Grüße aus Köln! 🙂")
    reply = request(chat_tokenizer, "/detokenize", {"model": NAME, "tokens": ids})
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"prompt": embedded_tokenizer.decode(ids)}


def test_version(chat_tokenizer: Any) -> None:
    reply = request(chat_tokenizer, "/version")
    assert reply.status_code == 200
    assert reply.json() == {"version": importlib.metadata.version("vmesh")}


@pytest.mark.parametrize(("path", "body", "status", "param", "message"), [
    ("/tokenize", {"model": "other", "prompt": "hi"}, 404, "model", "model: the model 'other' does not exist"),
    ("/tokenize", {"prompt": "hi", "messages": CHAT}, 400, "prompt", "prompt: give exactly one of prompt and messages"),
    ("/tokenize", {}, 400, "prompt", "prompt: give exactly one of prompt and messages"),
    ("/tokenize", {"messages": []}, 400, "messages", "messages: at least one message is required"),
    ("/tokenize", {"messages": [{"role": "hacker", "content": "x"}]}, 400, "messages[0].role",
     "messages[0].role: 'hacker' is not supported"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, 400, "continue_final_message",
     "continue_final_message: not supported by vmesh"),
    ("/tokenize", {"prompt": "y" * 65}, 400, "prompt", "prompt: 65 bytes of text; at most 64 are accepted"),
    ("/detokenize", {"tokens": [1, 49152]}, 400, "tokens[1]", "tokens[1]: 49152 is outside the vocabulary [0, 49152)"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens[0]", "tokens[0]: -1 is outside the vocabulary"),
])
def test_refusals(chat_tokenizer: Any, path: str, body: dict[str, Any], status: int, param: str,
                        message: str) -> None:
    reply = request(chat_tokenizer, path, body, max_prompt_bytes=64)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param
    assert error["message"].startswith(message)


def test_refused_while_starting() -> None:
    """No tokenizer loaded yet: 503, as generation requests get."""
    reply = request(None, "/tokenize", {"prompt": "hi"})
    assert reply.status_code == 503, reply.text
