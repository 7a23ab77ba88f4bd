"""One semantics on both APIs: the same chat roles and rules on gRPC as on HTTP, every HTTP
`param` a JSON path in one notation, and a service that cannot start says so in one line."""
from __future__ import annotations

import asyncio
import socket

import grpc
import httpx
import pytest

from tests.support.fake_scheduler import FakeScheduler
from tests.support.frontends import serving_frontend
from tests.support.grpc_fakes import Aborted, FakeContext
from vmesh.services.cli import main
from vmesh.services.common.types import ModelLimits
from vmesh.services.frontend import openai_protocol as oai
from vmesh.services.frontend.http_server import build_app
from vmesh.services.frontend.server import FrontendServicer
from vmesh.v1 import common_pb2, frontend_pb2

# (message, the field both APIs blame; None: both accept it)
CHATS = [
    ({"role": "hacker", "content": "hi"}, "role"),
    ({"role": "", "content": "hi"}, "role"),
    ({"role": "tool", "content": "42"}, "tool_call_id"),
    ({"role": "user", "content": "hi", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]},
     "tool_calls"),
    ({"role": "developer", "content": "Be brief."}, None),
    ({"role": "tool", "content": "42", "tool_call_id": "c"}, None),
]


def _grpc_chat(message: dict) -> frontend_pb2.GenerateRequest:
    calls = [frontend_pb2.ToolCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"])
             for c in message.get("tool_calls", ())]
    pb = frontend_pb2.ChatMessage(role=message["role"], content=message["content"], tool_calls=calls,
                                  tool_call_id=message.get("tool_call_id", ""))
    user = frontend_pb2.ChatMessage(role="user", content="What is 6 x 7?")
    return frontend_pb2.GenerateRequest(chat=frontend_pb2.ChatMessages(messages=[user, pb]),
                                        sampling=common_pb2.SamplingParams(max_tokens=2))


@pytest.mark.parametrize(("message", "blamed"), CHATS, ids=[f"{m['role'] or 'empty'}-{b}" for m, b in CHATS])
def test_grpc_chat_takes_the_roles_and_rules_http_takes(embedded_tokenizer, message, blamed):
    async def main_():
        f, scheduler = await serving_frontend(embedded_tokenizer, FakeScheduler(ModelLimits("m", 2048, 49152)))
        call = asyncio.create_task(_drain(FrontendServicer(f).Generate(_grpc_chat(message), FakeContext())))
        transport = httpx.ASGITransport(app=build_app(f, None))
        async with httpx.AsyncClient(transport=transport, base_url="http://frontend") as http:
            body = {"messages": [{"role": "user", "content": "What is 6 x 7?"}, message], "max_tokens": 2}
            http_call = asyncio.create_task(http.post("/v1/chat/completions", json=body))
            if blamed is None:  # both taken: the scheduler sees two submissions, then the test leaves
                waiting = asyncio.ensure_future(scheduler.until_submitted(2))
                await asyncio.wait([waiting, call, http_call], return_when=asyncio.FIRST_COMPLETED)
                assert waiting.done(), (call.done() and call.exception(), http_call.done() and http_call.result().text)
                call.cancel()
                http_call.cancel()
                await asyncio.gather(call, http_call, return_exceptions=True)
                await f.schedulers.close()
                return None, None
            grpc_refusal = await asyncio.gather(call, return_exceptions=True)
            response = await http_call
        await f.schedulers.close()
        return grpc_refusal[0], response

    grpc_refusal, response = asyncio.run(main_())
    if blamed is None:
        return
    assert isinstance(grpc_refusal, Aborted) and grpc_refusal.code == grpc.StatusCode.INVALID_ARGUMENT
    assert str(grpc_refusal).startswith(f"chat.messages[1].{blamed}: ")
    assert response.status_code == 400 and response.json()["error"]["param"] == f"messages[1].{blamed}"


async def _drain(stream) -> list:
    return [x async for x in stream]


@pytest.mark.parametrize(("loc", "path"), [
    (("body", "messages", 0, "content", "str"), "messages[0].content"),
    (("body", "prompt", "list[list[int]]", 2, 1), "prompt[2][1]"),
    (("body", "stream_options", "include_usage"), "stream_options.include_usage"),
    (("body", "logit_bias", "a b"), 'logit_bias["a b"]'),
    (("body",), None),
])
def test_pydantic_locations_become_the_one_json_path_notation(loc, path):
    assert oai.json_path(loc) == path


@pytest.mark.parametrize(("path", "body", "param", "message"), [
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": 5}]}', "messages[0].content",
     "messages[0].content: Input should be a valid string"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}, {"role": 5}]}', "messages[1].role",
     "messages[1].role: "),
    ("/v1/completions", '{"prompt": "x",', None, "body: not valid JSON at character 15"),
])
def test_http_params_of_invalid_bodies_are_json_paths(path, body, param, message):
    async def main_():
        f, _ = await serving_frontend(object())
        transport = httpx.ASGITransport(app=build_app(f, None))
        async with httpx.AsyncClient(transport=transport, base_url="http://frontend") as http:
            response = await http.post(path, content=body, headers={"content-type": "application/json"})
        await f.schedulers.close()
        return response

    response = asyncio.run(main_())
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(message)


def test_a_frontend_whose_http_port_is_taken_says_so_in_one_line(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["--log-level", "ERROR", "frontend", "--port", "0", "--scheduler", "127.0.0.1:1",
                     "--detokenizer-addresses", "127.0.0.1:2", "--http-port", str(port)])
    err = capsys.readouterr().err.strip()
    assert code == 1 and "Traceback" not in err
    assert err.splitlines() == [f"vmesh: error: [Errno 98] cannot bind the HTTP API to 127.0.0.1:{port}: "
                                "Address already in use"]
