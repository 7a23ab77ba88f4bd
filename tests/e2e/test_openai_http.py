"""The frontend's OpenAI-compatible HTTP API against a running mesh, driven by the real `openai`
package and plain httpx: shapes, streaming, n, logprobs, stop, seeds, usage, errors, API keys,
disconnects, and a property-based fuzz run. Everything on 127.0.0.1, ports chosen at run time."""

from __future__ import annotations

import asyncio
import json
import socket
from urllib.parse import urlsplit

import grpc
import httpx
import openai
import pytest

from tests.e2e.conftest import scheduler_stats, wait_idle
from vmesh.services.bench.mesh import start_mesh
from vmesh.services.client import VmeshClient

KEY = "test-key"
CHAT = [{"role": "user", "content": "Count from 1 to 10 with commas."}]


@pytest.fixture(scope="module")
def mesh():
    mesh = start_mesh("--api-key", KEY)
    yield mesh
    mesh.stop()


@pytest.fixture(scope="module")
def model(mesh) -> str:
    return openai.OpenAI(base_url=mesh.http_url, api_key=KEY, max_retries=0).models.list().data[0].id


def sync_client(mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.http_url, api_key=KEY, max_retries=0, timeout=120)


def root(mesh) -> str:
    return mesh.http_url.removesuffix("/v1")


def test_models_health_metrics_openapi(mesh, model):
    assert model == "SmolLM2-135M-Instruct"
    with httpx.Client(base_url=root(mesh), timeout=30) as http:
        assert http.get("/health").status_code == 200  # open without the key
        assert "vmesh:time_to_first_token_seconds" in http.get("/metrics").text
        paths = http.get("/openapi.json").json()["paths"]
        assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(paths)


def test_models_retrieve_usage_nulls_and_emoji_logprobs(mesh, model):
    """The client's models.retrieve; every streamed chunk before the usage chunk says
    "usage": null; completions' logprobs over emoji name partial tokens by their bytes and
    offset into the text, streamed as whole."""
    client = sync_client(mesh)
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such-model")
    assert missing.value.code == "model_not_found" and missing.value.type == "invalid_request_error"

    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": model, "messages": CHAT, "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}
    with (httpx.Client(base_url=mesh.http_url, timeout=60, headers=headers) as http,
          http.stream("POST", "/chat/completions", json=body) as events):
        chunks = [json.loads(line[len("data: "):]) for line in events.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-1]["usage"]["completion_tokens"] == 4

    prompt = "Emoji: 🌍🚀🎉🍕"
    for stream in (False, True):
        request = dict(model=model, prompt=prompt, max_tokens=8, temperature=0, logprobs=1, echo=not stream,
                       stream=stream, extra_body={"ignore_eos": True})
        if stream:
            pieces = list(client.completions.create(**request))
            text = "".join(p.choices[0].text for p in pieces)
            tokens = [t for p in pieces if p.choices[0].logprobs for t in p.choices[0].logprobs.tokens]
            offsets = [o for p in pieces if p.choices[0].logprobs for o in p.choices[0].logprobs.text_offset]
        else:
            done = client.completions.create(**request).choices[0]
            text, tokens, offsets = done.text, done.logprobs.tokens, done.logprobs.text_offset
            assert text.startswith(prompt) and any(t.startswith("bytes:") for t in tokens)
        # <=: a last token that begins a character max_tokens cut off is at the text's end
        assert len(tokens) == len(offsets) and offsets == sorted(offsets) and offsets[-1] <= len(text)
        for token, offset in zip(tokens, offsets):
            assert token.startswith("bytes:") or text.startswith(token, offset), (token, offset, text)


def test_sync_client_chat_and_completions(mesh, model, embedded_tokenizer):
    client = sync_client(mesh)
    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=60, temperature=0, stop=["5"])
    choice = chat.choices[0]
    assert choice.finish_reason == "stop" and "5" not in choice.message.content and "4" in choice.message.content
    prompt_tokens = len(embedded_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True,
                                                               return_dict=False))
    assert chat.usage.prompt_tokens == prompt_tokens
    assert chat.usage.total_tokens == prompt_tokens + chat.usage.completion_tokens
    with httpx.Client(base_url=root(mesh), timeout=30, headers={"Authorization": f"Bearer {KEY}"}) as http:
        counted = http.post("/tokenize", json={"model": model, "messages": CHAT}).json()
        served = http.get("/v1/models").json()["data"][0]
    assert counted["count"] == prompt_tokens and counted["max_model_len"] == served["max_model_len"]

    done = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4, temperature=0,
                                     logprobs=2, extra_body={"ignore_eos": True})
    lp = done.choices[0].logprobs
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 4
    assert len(lp.tokens) == len(lp.token_logprobs) == 4 and "".join(lp.tokens) == done.choices[0].text
    for logprob, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 2 and max(top.values()) == pytest.approx(logprob, abs=1e-4)  # greedy: the top one

    streamed = client.completions.create(model=model, prompt=[[1, 100, 200], [1, 300]], n=2, max_tokens=3,
                                         stream=True, stream_options={"include_usage": True},
                                         extra_body={"ignore_eos": True})
    texts: dict[int, str] = {}
    usage = None
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
        usage = chunk.usage or usage
    assert sorted(texts) == [0, 1, 2, 3]
    assert usage.prompt_tokens == 5 and usage.completion_tokens == 12  # each prompt once; every choice


def test_chat_logprobs_seed_and_n(mesh, model):
    client = sync_client(mesh)
    lp = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                        temperature=0, logprobs=True, top_logprobs=3)
    entries = lp.choices[0].logprobs.content
    assert len(entries) == lp.usage.completion_tokens
    for e in entries:
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-4)
        assert e.top_logprobs[0].token == e.token
    assert "".join(e.token for e in entries) == lp.choices[0].message.content
    assert bytes(b for e in entries for b in e.bytes).decode() == lp.choices[0].message.content

    def seeded() -> list[str]:
        # A seeded draw is reproducible for bit-identical logits; a step's row count can change their
        # last bits (another kernel path), which moves a draw only when it lands that close to a
        # boundary between tokens. top_k keeps the boundaries apart (over the full vocabulary at
        # temperature 1 they are ~1e-3 wide, and 24 draws hit one now and then).
        out = client.chat.completions.create(model=model, messages=CHAT, max_tokens=12, temperature=1.0, seed=42,
                                             n=2, extra_body={"top_k": 5})
        assert sorted(c.index for c in out.choices) == [0, 1]
        return [c.message.content for c in sorted(out.choices, key=lambda c: c.index)]

    first, second = seeded(), seeded()
    assert first == second  # the same seed, the same draws, choice by choice
    assert first[0] != first[1]  # ...yet the two choices differ (seed + index)


def test_async_client_streams_chat_and_completions(mesh, model):
    async def main():
        client = openai.AsyncOpenAI(base_url=mesh.http_url, api_key=KEY, max_retries=0, timeout=120)
        stream = await client.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0,
                                                      stream=True, stream_options={"include_usage": True})
        deltas, finish, usage, roles = [], None, None, []
        async for chunk in stream:
            for c in chunk.choices:
                roles += [c.delta.role] if c.delta.role else []
                deltas.append(c.delta.content or "")
                finish = c.finish_reason or finish
            usage = chunk.usage or usage
        whole = await client.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0)
        done = await client.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0)
        await client.close()
        return "".join(deltas), roles, finish, usage, whole, done

    text, roles, finish, usage, whole, done = asyncio.run(main())
    assert roles == ["assistant"] and finish == "length" and usage.completion_tokens == 8
    assert text == whole.choices[0].message.content  # streamed and whole agree
    assert done.object == "text_completion" and done.usage.completion_tokens == 3


def test_greedy_chat_over_http_equals_grpc(mesh, model):
    prompts = ["Why is the sky blue?", "Write a haiku about the sea.", "What is 17 * 3?", "Name three colours."]

    async def main():
        client = openai.AsyncOpenAI(base_url=mesh.http_url, api_key=KEY, max_retries=0, timeout=120)
        http = await asyncio.gather(*(client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": p}], max_tokens=32, temperature=0) for p in prompts))
        await client.close()
        async with VmeshClient(mesh.address, api_key=KEY) as grpc_client:
            via_grpc = await asyncio.gather(*(grpc_client.complete(
                chat=[{"role": "user", "content": p}], max_tokens=32, temperature=0) for p in prompts))
        return [r.choices[0].message.content for r in http], [text for text, _ids, _last in via_grpc]

    http, via_grpc = asyncio.run(main())
    assert http == via_grpc


def test_disconnect_mid_stream_aborts_and_frees_blocks(mesh, model):
    async def main():
        async with httpx.AsyncClient(base_url=root(mesh), timeout=120,
                                     headers={"Authorization": f"Bearer {KEY}"}) as http:
            async def stream_then_leave(i: int) -> int:
                body = {"model": model, "prompt": f"Tell me a long story number {i}", "max_tokens": 1000,
                        "ignore_eos": True, "stream": True}
                got = 0
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        got += line.startswith("data: ")
                        if got == 3:
                            break  # leaving the block closes the connection mid-stream
                return got

            async def whole_then_leave() -> None:
                body = {"model": model, "prompt": "Write an essay", "max_tokens": 1000, "ignore_eos": True}
                task = asyncio.create_task(http.post("/v1/completions", json=body))
                while (await asyncio.to_thread(scheduler_stats, mesh)).num_running < 1:  # it is generating
                    await asyncio.sleep(0.05)
                task.cancel()  # closes the connection before the response
                with pytest.raises(asyncio.CancelledError):
                    await task

            got = await asyncio.gather(*(stream_then_leave(i) for i in range(4)))
            await whole_then_leave()
            return got

    assert asyncio.run(main()) == [3] * 4
    stats = wait_idle(mesh)
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.num_used_blocks == 0


def test_api_key_guards_http_and_grpc(mesh, model):
    with httpx.Client(base_url=root(mesh), timeout=30) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions")):
                r = http.request(method, path, headers=headers, json={"messages": CHAT})
                assert r.status_code == 401
                assert r.json()["error"]["type"] == "authentication_error"
        assert http.get("/health").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=mesh.http_url, api_key="wrong", max_retries=0).models.list()

    async def via_grpc(key: str | None):
        async with VmeshClient(mesh.address, api_key=key) as client:
            try:
                await client.complete(text="Hi", max_tokens=2)
                return grpc.StatusCode.OK
            except grpc.aio.AioRpcError as exc:
                return exc.code()

    assert asyncio.run(via_grpc(None)) == grpc.StatusCode.UNAUTHENTICATED
    assert asyncio.run(via_grpc("wrong")) == grpc.StatusCode.UNAUTHENTICATED
    assert asyncio.run(via_grpc(KEY)) == grpc.StatusCode.OK


BAD = [  # (endpoint, body, status, param)
    ("completions", {"prompt": "hi", "model": "no-such-model"}, 404, "model"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": "hi " * 9000}, 400, "prompt"),
    ("completions", {"prompt": "x" * ((1 << 20) + 1)}, 400, "prompt"),  # over the byte limit: never tokenized
    ("completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 100_000}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("completions", {"prompt": "hi", "top_k": -2}, 400, "top_k"),
    ("completions", {"prompt": "hi", "min_p": 2}, 400, "min_p"),
    ("completions", {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ("completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("completions", {"prompt": "hi", "logprobs": 6}, 400, "logprobs"),  # OpenAI's cap: 5
    ("completions", {"prompt": "hi", "stop": [f"s{i}" for i in range(40)]}, 400, "stop"),
    ("completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("completions", {"prompt": "hi", "n": 1000}, 400, "n"),
    ("completions", {"prompt": [1, 2, 999_999]}, 400, "prompt"),
    ("completions", {"prompt": "hi", "echo": True, "stream": True}, 400, "echo"),
    ("completions", {"prompt": "hi", "suffix": "end"}, 400, "suffix"),
    ("completions", {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("completions", {"prompt": "hi", "logit_bias": {"1": 5}}, 400, "logit_bias"),
    ("completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("completions", {}, 400, "prompt"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {"description": "f"}}]},
     400, "tools[0].function.name"),
    ("chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema"}}, 400,
     "response_format.json_schema"),
    ("chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].tool_call_id"),
    ("chat/completions", {"messages": [{"role": "critic", "content": "x"}]}, 400, "messages[0].role"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content[0]"),
    ("chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
]


def test_invalid_requests_get_openai_errors_naming_the_field(mesh, model):
    with httpx.Client(base_url=mesh.http_url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as http:
        for endpoint, body, status, param in BAD:
            r = http.post(f"/{endpoint}", json=body)
            error = r.json()["error"]
            assert (r.status_code, error["param"]) == (status, param), (endpoint, body, r.text[:300])
            assert error["message"] and error["type"] == "invalid_request_error"  # OpenAI's, 404 included
            assert error["code"] == ("model_not_found" if status == 404 else None)
            # the message names the field as the body spells it, not as the gRPC API does
            assert error["message"].startswith(f"{param}: ") or param is None, error["message"]
            assert set(error) == {"message", "type", "param", "code"}
        r = http.post("/completions", content=b"{not json", headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "error" in r.json()
        # JSON may spell a lone surrogate, which no UTF-8 (nor protobuf) can carry.
        for endpoint, raw, param in (("completions", rb'{"prompt": "a\ud800"}', "prompt"),
                                     ("chat/completions", rb'{"messages": [{"role": "user", "content": "x\udc00"}]}',
                                      "messages[0].content")):
            r = http.post(f"/{endpoint}", content=raw, headers={"Content-Type": "application/json"})
            assert (r.status_code, r.json()["error"]["param"]) == (400, param), r.text[:300]
        # ...and the mesh keeps serving.
        assert http.post("/completions", json={"prompt": "Say yes.", "max_tokens": 2}).status_code == 200


def test_an_oversized_body_is_refused_by_its_content_length(mesh, model):
    """413 from the declared length alone: the body is never sent, let alone buffered."""
    url = urlsplit(mesh.http_url)
    with socket.create_connection((url.hostname, url.port), timeout=60) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {url.hostname}\r\nAuthorization: Bearer {KEY}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {1 << 40}\r\n\r\n".encode())
        reply = b""
        while b"\r\n\r\n" not in reply:
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]


def test_fuzzed_bodies_never_get_a_5xx(mesh, model):
    """Hypothesis over the request models' fields: well-typed and ill-typed values alike, in
    bounded numbers (a few hundred requests, each at most a few tokens)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from vmesh.services.frontend.openai_protocol import ChatCompletionRequest, CompletionRequest

    junk = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                   max_size=3), max_leaves=6)
    plausible = {
        "model": st.sampled_from([model, model, model, "other"]), "max_tokens": st.integers(-2, 3),
        "n": st.integers(-1, 3),
        "max_completion_tokens": st.integers(-2, 3), "temperature": st.floats(-1, 3), "top_p": st.floats(-0.5, 1.5),
        "top_k": st.integers(-3, 50), "min_p": st.floats(-0.5, 1.5), "seed": st.integers(-(2**70), 2**70),
        "stream": st.booleans(), "logprobs": st.one_of(st.booleans(), st.integers(-1, 25)),
        "top_logprobs": st.integers(-1, 25), "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3))),
        "prompt": st.one_of(st.text(max_size=20), st.lists(st.integers(-5, 60_000), max_size=5),
                            st.lists(st.text(max_size=5), max_size=3)),
        "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "x"]),
                                                    "content": st.one_of(st.text(max_size=20), junk)}), max_size=3),
        "stream_options": st.one_of(st.none(), st.fixed_dictionaries({"include_usage": st.booleans()})),
    }

    def body(model_cls, required: str) -> st.SearchStrategy[dict]:
        """Mostly plausible values (so that many requests reach the mesh), some of any JSON type,
        now and then a field set to junk."""
        fields = [f for f in model_cls.model_fields if f != required]

        def value(f: str) -> st.SearchStrategy:
            return st.one_of(plausible[f], plausible[f], plausible[f], junk) if f in plausible else junk

        junked = st.one_of(st.just({}), st.just({}), st.dictionaries(st.sampled_from(fields), junk, max_size=2))
        return st.tuples(junked, st.fixed_dictionaries({required: value(required)},
                                                       optional={f: value(f) for f in fields})).map(
            lambda parts: {**parts[1], **parts[0]})

    http = httpx.Client(base_url=mesh.http_url, timeout=60, headers={"Authorization": f"Bearer {KEY}"})
    statuses: list[int] = []

    @settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.one_of(body(CompletionRequest, "prompt").map(lambda b: ("/completions", b)),
                     body(ChatCompletionRequest, "messages").map(lambda b: ("/chat/completions", b))))
    def check(case):
        path, payload = case
        if isinstance(payload.get("max_tokens"), int) and payload["max_tokens"] > 4:
            payload["max_tokens"] = 4  # bounded work per example
        payload.setdefault("max_tokens", 4)
        if isinstance(payload.get("max_completion_tokens"), int) and payload["max_completion_tokens"] > 4:
            payload["max_completion_tokens"] = 4
        r = http.post(path, content=json.dumps(payload), headers={"Content-Type": "application/json"})
        statuses.append(r.status_code)
        assert r.status_code < 500, (path, payload, r.text[:500])
        if r.status_code >= 400:
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"]

    try:
        check()
    finally:
        http.close()
    print(f"fuzz statuses: { {s: statuses.count(s) for s in set(statuses)} }")
    assert any(s == 200 for s in statuses) and any(s >= 400 for s in statuses)
    stats = wait_idle(mesh)
    assert stats.num_running == 0 and stats.num_used_blocks == 0
    assert sync_client(mesh).completions.create(model=model, prompt="Hi", max_tokens=2).usage.completion_tokens >= 1


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_auto_tool_calls_streamed_and_not_read_the_models_text_alike(mesh, model, embedded_tokenizer):
    """Whatever SmolLM2 answers (a call or not), the message is its text read by the Hermes
    parser, and the streamed deltas (assembled by the openai client's own helper) say the same."""
    from vmesh.services.common.tokenizer import encode_chat
    from vmesh.services.frontend.tool_parsers import HermesToolCallParser, parse_text

    client = sync_client(mesh)
    messages = [{"role": "system", "content": "Answer with a tool call."},
                {"role": "user", "content": "What is the weather in Paris?"}]
    request = {"model": model, "messages": messages, "tools": [WEATHER_TOOL], "tool_choice": "auto",
               "max_tokens": 48, "temperature": 0}
    plain = client.chat.completions.create(**request)
    with client.chat.completions.stream(**request) as stream:
        streamed = stream.get_final_completion()
    # the model's raw text for the same prompt, the tools prompt included
    raw = client.completions.create(model=model, prompt=encode_chat(embedded_tokenizer, messages, [WEATHER_TOOL]),
                                    max_tokens=48, temperature=0).choices[0]
    content, calls = parse_text(HermesToolCallParser(["get_weather"]), raw.text)
    for completion in (plain, streamed):
        choice = completion.choices[0]
        assert choice.message.content == content
        got = [(c.type, c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
        assert got == [("function", c["function"]["name"], c["function"]["arguments"]) for c in calls]
        assert all(c.id.startswith("call_") for c in choice.message.tool_calls or ())
        assert choice.finish_reason == ("tool_calls" if calls and raw.finish_reason == "stop" else raw.finish_reason)
