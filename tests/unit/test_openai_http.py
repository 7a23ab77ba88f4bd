"""The frontend's HTTP shell without a network or a mesh: the ASGI app is driven directly, a fake
scheduler takes submissions, and the test plays the detokenizer by filling each request's
Outbox. Covers what only shows between the HTTP layer and the request path: tokenizing once
for n copies, starting a stream on the first choice, closing a stream's requests however it
ends, bounded fan-out memory, body limits, cancellation, aborted requests and logprob bytes."""
from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.support.eventually import eventually
from tests.support.frontends import make_frontend, serving_frontend
from vmesh.services.common.generation import GenerationOutput
from vmesh.services.common.types import OutputBatch, StreamOutput, TokenLogprobs
from vmesh.services.common.wire.common import finish_from_proto
from vmesh.services.frontend import openai_protocol as oai
from vmesh.services.frontend import openai_responses as render
from vmesh.services.frontend.core import FrontendCore
from vmesh.services.frontend.errors import RequestError
from vmesh.services.frontend.fanout import Fanout, until_disconnect
from vmesh.services.frontend.http_middleware import body_limit
from vmesh.services.frontend.http_reply import Reply, sse
from vmesh.services.frontend.http_server import build_app
from vmesh.v1 import common_pb2

LENGTH = common_pb2.FINISH_REASON_LENGTH
ABORT = common_pb2.FINISH_REASON_ABORT


class CharTokenizer:
    """One token per character (id = code point); counts its calls."""

    def __init__(self) -> None:
        self.encodes = 0
        self.decodes = 0

    def encode(self, text: str) -> list[int]:
        self.encodes += 1
        return [ord(c) for c in text]

    def apply_chat_template(self, messages: list[dict], **kwargs: Any) -> list[int]:
        self.encodes += 1
        return [ord(c) for m in messages for c in m["content"]]

    def decode(self, ids: list[int]) -> str:
        self.decodes += 1
        return "".join(map(chr, ids))


def emit(f: FrontendCore, text: str, finish: int = 0, keys: list[int] | None = None) -> None:
    """Play the detokenizer: `text` (one token per character) to the given requests (all: None)."""
    f.dispatch(OutputBatch([StreamOutput(key, text, [ord(c) for c in text], finish_from_proto(finish), 0, 0, 0)
                            for key in (list(f.outboxes) if keys is None else keys)]))


class Call:
    """One request over raw ASGI, so that a test sees each message as it is sent (httpx's ASGI
    transport hands back a streamed body only once it is complete)."""

    def __init__(self, app: Any, path: str, body: dict, spec_version: str = "2.3",
                 fail_on_start: bool = False, headers: dict[str, str] | None = None):
        raw = json.dumps(body).encode()
        self.sent: list[dict] = []
        self.inbox: asyncio.Queue[dict] = asyncio.Queue()
        self.inbox.put_nowait({"type": "http.request", "body": raw, "more_body": False})
        self.fail_on_start = fail_on_start
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
                 "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
                 "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
                             *((k.lower().encode(), v.encode()) for k, v in (headers or {}).items())]}
        self.task = asyncio.create_task(app(scope, self.inbox.get, self._send))

    async def _send(self, message: dict) -> None:
        if self.fail_on_start and message["type"] == "http.response.start":
            raise OSError("the client is gone")  # what uvicorn's send raises once the peer closed
        self.sent.append(message)

    @property
    def status(self) -> int | None:
        return next((m["status"] for m in self.sent if m["type"] == "http.response.start"), None)

    @property
    def body(self) -> str:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body").decode()

    def events(self) -> list[Any]:
        return [line.removeprefix("data: ") for line in self.body.splitlines() if line.startswith("data: ")]


def test_n_copies_tokenize_the_prompt_once_and_carry_its_ids():
    async def main():
        tokenizer = CharTokenizer()
        f, scheduler = await serving_frontend(tokenizer)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(f, None)),
                                     base_url="http://frontend") as http:
            for path, body in (("/v1/completions", {"prompt": "hi", "n": 4, "max_tokens": 2}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 3,
                                                         "max_tokens": 2})):
                before, submitted = tokenizer.encodes, len(scheduler.submitted)
                call = asyncio.create_task(http.post(path, json=body))
                await scheduler.until_submitted(submitted + body["n"])
                emit(f, "ok", LENGTH)
                response = await call
                assert response.status_code == 200, response.text
                assert tokenizer.encodes - before == 1  # not once per copy
                assert [list(s.prompt_token_ids) for s in scheduler.submitted[submitted:]] == [[104, 105]] * body["n"]
                assert len(response.json()["choices"]) == body["n"]

    asyncio.run(main())


def test_a_stream_starts_with_its_first_choice_and_its_other_choices_follow():
    async def main():
        f, scheduler = await serving_frontend(CharTokenizer())
        call = Call(build_app(f, None), "/v1/completions", {"prompt": [1, 2], "n": 3, "max_tokens": 2,
                                                            "stream": True})
        await scheduler.until_submitted(3)
        first, *others = list(f.outboxes)
        emit(f, "a", keys=[first])
        await eventually(lambda: call.status is not None)  # the others have sent nothing yet
        assert call.status == 200
        emit(f, "b", LENGTH, keys=others)
        emit(f, "c", LENGTH, keys=[first])
        await call.task
        chunks = [json.loads(e) for e in call.events()[:-1]]
        assert call.events()[-1] == "[DONE]"
        text = {i: "".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i)
                for i in range(3)}
        assert text == {0: "ac", 1: "b", 2: "b"}

    asyncio.run(main())


# n = 1 is read in the response's own task (no pump task between), n > 1 through the fan-out's queue.
@pytest.mark.parametrize("n", [1, 2])
def test_a_stream_whose_client_left_as_it_started_aborts_its_requests(n: int):
    """Starlette may stop a streaming response before its body generator runs (here: sending the
    response start fails); the fan-out must be closed all the same."""

    async def main():
        f, scheduler = await serving_frontend(CharTokenizer())
        call = Call(build_app(f, None), "/v1/completions", {"prompt": [1, 2], "n": n, "max_tokens": 500,
                                                            "stream": True}, spec_version="2.4", fail_on_start=True)
        await scheduler.until_submitted(n)
        emit(f, "a")
        await asyncio.gather(call.task, return_exceptions=True)
        await eventually(lambda: f.in_flight == 0 and not f.background)
        return sorted(scheduler.aborted), sorted(s.frontend_key for s in scheduler.submitted)

    aborted, submitted = asyncio.run(main())
    assert aborted == submitted


@pytest.mark.parametrize("n", [1, 2])
def test_a_non_streaming_request_whose_client_left_aborts_its_requests(n: int):
    async def main():
        f, scheduler = await serving_frontend(CharTokenizer())
        call = Call(build_app(f, None), "/v1/completions", {"prompt": [1, 2], "n": n, "max_tokens": 500})
        await scheduler.until_submitted(n)
        emit(f, "a")
        call.inbox.put_nowait({"type": "http.disconnect"})
        await call.task
        await eventually(lambda: f.in_flight == 0 and not f.background)
        return call.status, sorted(scheduler.aborted), sorted(s.frontend_key for s in scheduler.submitted)

    status, aborted, submitted = asyncio.run(main())
    assert status == 499 and aborted == submitted


@pytest.mark.parametrize("n", [1, 2])
def test_a_stream_whose_client_left_midway_aborts_its_requests(n: int):
    async def main():
        f, scheduler = await serving_frontend(CharTokenizer())
        call = Call(build_app(f, None), "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                                 "n": n, "max_tokens": 500, "stream": True})
        await scheduler.until_submitted(n)
        emit(f, "a")
        await eventually(lambda: len(call.events()) == 2 * n)  # each choice's role, then its "a"
        emit(f, "b")
        call.inbox.put_nowait({"type": "http.disconnect"})
        await call.task
        await eventually(lambda: f.in_flight == 0 and not f.background)
        return sorted(scheduler.aborted), sorted(s.frontend_key for s in scheduler.submitted)

    aborted, submitted = asyncio.run(main())
    assert aborted == submitted


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("chat", [True, False])
def test_plain_chunks_are_the_chunks_json_byte_for_byte(chat: bool, include_usage: bool):
    """Reply.plain_chunk writes a chunk without building it: the same bytes as json.dumps of the
    chunk, for any text (escapes, non-ASCII, a lone surrogate) and model name; with
    include_usage, `"usage": null` on each (OpenAI's chunks before the usage chunk)."""
    texts = ["", "a", " hello", 'quo"te \\ back', "tab\tnew\nline\r\x00\x1f\x7f", "café Über", "🦊 \u2028",
             "\ud800", "</script>"]
    for model in ("m", 'we"ird\\ módel 🦊'):
        reply = Reply(model, chat=chat, prompts=1, n=1, stream=True, include_usage=include_usage,
                      want_logprobs=False, aliases={})
        assert ("usage" in reply.chunk([])) == include_usage and reply.chunk([], usage={"x": 1})["usage"] == {"x": 1}
        for index, text, finish in itertools.product((0, 7), texts, (None, "stop", "length")):
            if chat:
                choice = {"index": index, "delta": {"content": text} if text else {}, "logprobs": None,
                          "finish_reason": finish}
            else:
                choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
            expected = json.dumps(reply.chunk([choice]), separators=(",", ":"))
            assert reply.plain_chunk(index, text, finish) == expected
            assert sse(reply.plain_chunk(index, text, finish), "k.1.2") == sse(reply.chunk([choice]), "k.1.2")
            assert sse(reply.chunk([choice])) == f"data: {expected}\n\n"


@pytest.mark.parametrize("stream", [False, True])
def test_an_aborted_request_is_an_error_not_an_abort_finish_reason(stream: bool):
    async def main():
        f, scheduler = await serving_frontend(CharTokenizer())
        call = Call(build_app(f, None), "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": stream})
        await scheduler.until_submitted(1)
        if stream:
            emit(f, "a")
            await eventually(lambda: call.status is not None)
        emit(f, "", ABORT)
        await call.task
        return call

    call = asyncio.run(main())
    assert "abort\"" not in call.body
    if not stream:
        assert call.status == 503 and json.loads(call.body)["error"]["type"] == "service_unavailable_error"
        return
    assert call.status == 200
    *chunks, error, done = call.events()
    assert done == "[DONE]" and json.loads(error)["error"]["type"] == "service_unavailable_error"
    assert all(json.loads(c)["choices"][0]["finish_reason"] is None for c in chunks)


def test_a_slow_reader_holds_a_bounded_number_of_outputs():
    """A reader that takes nothing: each stream is pulled only a bounded number of times (the
    rest would merge in the request's Outbox), and closing the fan-out closes every stream."""
    pulled = [0, 0, 0]
    closed: set[int] = set()

    async def stream(i: int, count: int) -> AsyncIterator[GenerationOutput]:
        try:
            for k in range(count):
                pulled[i] += 1
                yield GenerationOutput("", f"{i}.{k} ", [], [])
                await asyncio.sleep(0)
        finally:
            closed.add(i)

    async def main():
        fanout = Fanout([stream(i, 300) for i in range(3)])
        for _ in range(3000):  # every stream could have been drained ten times over
            await asyncio.sleep(0)
        assert sum(pulled) <= 2 * len(pulled), pulled
        got: dict[int, list[str]] = {0: [], 1: [], 2: []}
        async for index, out in fanout.events():
            got[index].append(out.text)
        assert got == {i: [f"{i}.{k} " for k in range(300)] for i in range(3)}

        stalled = Fanout([stream(i, 300) for i in range(3)])
        await eventually(lambda: stalled.queue.full())
        await stalled.close()
        assert closed == {0, 1, 2}

    asyncio.run(main())


def test_until_disconnect_lets_its_own_cancellation_through():
    class Connected:
        def __init__(self) -> None:
            self.messages: asyncio.Queue[dict] = asyncio.Queue()

        async def receive(self) -> dict:
            return await self.messages.get()

    async def main():
        work_cancelled = asyncio.Event()

        async def work() -> None:
            try:
                await asyncio.Event().wait()
            finally:
                work_cancelled.set()

        request = Connected()
        task = asyncio.create_task(until_disconnect(request, work()))  # type: ignore[arg-type]
        await eventually(lambda: request.messages._getters)  # type: ignore[attr-defined]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert work_cancelled.is_set()

        from vmesh.services.frontend.fanout import ClientGone  # a disconnect is still ClientGone

        request = Connected()
        request.messages.put_nowait({"type": "http.disconnect"})
        with pytest.raises(ClientGone):
            await until_disconnect(request, work())  # type: ignore[arg-type]

    asyncio.run(main())


def test_request_bodies_over_the_limit_are_refused_with_413():
    f = make_frontend(max_prompt_bytes=8, max_request_bytes=64 * 8)
    limit = body_limit(64 * 8)
    assert limit == 64 * 8 + 64 * 1024
    chunks_sent = 0

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: only counting can stop it
        nonlocal chunks_sent
        yield b'{"prompt": "'
        for _ in range(100):
            chunks_sent += 1
            yield b"x" * 4096
        yield b'"}'

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(f, None)),
                                     base_url="http://frontend") as http:
            declared = await http.post("/v1/completions", content=b"{" + b" " * limit + b"}",
                                       headers={"Content-Type": "application/json"})
            streamed = await http.post("/v1/completions", content=chunked(),
                                       headers={"Content-Type": "application/json"})
            small = await http.post("/v1/completions", json={"prompt": "hi"})
            return declared, streamed, small

    declared, streamed, small = asyncio.run(main())
    for response in (declared, streamed):
        assert response.status_code == 413, response.text
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        assert response.json()["error"]["type"] == "invalid_request_error"
    assert chunks_sent < 100  # refused while the body was arriving
    assert small.status_code == 503  # under the limit: served (this frontend is still starting)


def test_a_lone_surrogate_is_a_400_naming_the_field():
    async def main():
        f, _ = await serving_frontend(CharTokenizer())
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(f, None)),
                                     base_url="http://frontend") as http:
            out = []
            for path, raw in (("/v1/completions", rb'{"prompt": "a\ud800"}'),
                              ("/v1/completions", rb'{"prompt": ["ok", "a\ud800"]}'),
                              ("/v1/completions", rb'{"prompt": "a", "stop": "\udc00"}'),
                              ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "x\udc00"}]}'),
                              ("/v1/chat/completions",
                               rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}')):
                r = await http.post(path, content=raw, headers={"Content-Type": "application/json"})
                out.append((r.status_code, r.json()["error"]["param"]))
            return out

    assert asyncio.run(main()) == [(400, "prompt"), (400, "prompt"), (400, "stop"), (400, "messages[0].content"),
                                   (400, "messages[0].content[0].text")]


def test_logprob_tokens_are_decoded_once_each_and_logprobs_are_capped():
    tokenizer = CharTokenizer()
    tokens = render.TokenTable(tokenizer)
    entry = TokenLogprobs(logprob=-0.5, rank=0, top_token_ids=list(b"abcde"), top_logprobs=[-1.0] * 5)
    choice = render.Choice(text="ab" * 500, token_ids=[97, 98] * 500, logprobs=[entry] * 1000)
    body = render.completion_body("id", 0, "m", [choice] * 8, 8, True, tokens)
    assert body["choices"][0]["logprobs"]["tokens"][:2] == ["a", "b"]
    chat = render.chat_body("id", 0, "m", [choice] * 8, 8, True, tokens)
    assert chat["choices"][7]["logprobs"]["content"][1]["bytes"] == [98]
    assert tokenizer.decodes == 5  # a..e, once each, for 8 × 1000 × 6 × 2 mentions

    with pytest.raises(RequestError) as err:
        oai.completion_requests(oai.CompletionRequest(prompt="a", logprobs=6), "m")
    assert oai.request_error_body(err.value)[1]["error"]["param"] == "logprobs"
    assert oai.completion_requests(oai.CompletionRequest(prompt="a", logprobs=5), "m")[0].sampling.logprobs == 5
    with pytest.raises(RequestError) as err:
        oai.chat_request(oai.ChatCompletionRequest(messages=[{"role": "user", "content": "a"}], logprobs=True,
                                                   top_logprobs=21), "m")
    assert oai.request_error_body(err.value)[1]["error"]["param"] == "top_logprobs"


def test_chat_logprob_bytes_are_the_tokens_own_bytes(embedded_tokenizer):
    """A character split over tokens: each token's bytes are its share of the UTF-8, not the
    EF BF BD of the replacement character its text decodes to."""
    text = " 日本 héllo"
    ids = embedded_tokenizer.encode(text)
    tokens = render.TokenTable(embedded_tokenizer)
    assert any(tokens.text(i) == "\ufffd" for i in ids)  # the case that matters is present
    assert b"".join(tokens.raw(i) for i in ids) == text.encode()
    end = embedded_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokens.raw(end) == b"<|im_end|>"


def test_completion_logprobs_name_partial_characters_by_their_bytes_and_offset_into_the_text(embedded_tokenizer):
    """Legacy completions' logprobs over characters split across tokens: a token holding part of
    one is `bytes:` and its escapes (as OpenAI writes it; U+FFFD would make distinct tokens one
    key), and text_offset counts characters of the text, never decreasing, each token's text at
    its offset; split into streamed pieces, the offsets are the whole text's."""
    text = "Emoji: 🌍🚀🎉🍕 café 日本語 ok"
    ids = embedded_tokenizer.encode(text)
    tokens = render.TokenTable(embedded_tokenizer)
    entries = [TokenLogprobs(logprob=-0.5, rank=1, top_token_ids=[i], top_logprobs=[-0.5]) for i in ids]
    body = render.completion_logprobs(entries, ids, tokens)
    names, offsets = body["tokens"], body["text_offset"]
    partial = [n for n in names if n.startswith("bytes:")]
    assert partial and "\ufffd" not in "".join(names)  # the case that matters is present
    assert all(bytes.fromhex(n[len("bytes:"):].replace("\\x", "")) == tokens.raw(i)
               for n, i in zip(names, ids) if n.startswith("bytes:"))
    assert [list(top) for top in body["top_logprobs"]] == [[n] for n in names]
    assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] < len(text)
    for name, offset in zip(names, offsets):
        assert name.startswith("bytes:") or text.startswith(name, offset), (name, offset)
    assert render.text_offsets(ids, tokens)[1] == len(text)
    pieces, start = [], 0
    for cut in (3, 9, 10, 11, len(ids)):  # cuts inside characters too
        piece, start = render.text_offsets(ids[len(pieces):cut], tokens, start)
        pieces += piece
    assert pieces == offsets

    # An echo: the prompt's tokens from 0, the generated ones after the prompt's text.
    prompt = "Say 🌍"
    prompt_ids = embedded_tokenizer.encode(prompt)
    choice = render.Choice(text="", token_ids=ids, logprobs=entries, prompt_token_ids=prompt_ids,
                           prompt_logprobs=entries[:len(prompt_ids) - 1])
    echo = render.echo_logprobs(choice, prompt, tokens)
    assert echo["text_offset"] == render.text_offsets(prompt_ids, tokens)[0] + [len(prompt) + o for o in offsets]
    assert render.text_offsets(prompt_ids, tokens)[1] == len(prompt)
    assert echo["token_logprobs"][0] is None and len(echo["tokens"]) == len(prompt_ids) + len(ids)


def test_text_offsets_skip_what_the_text_leaves_out(embedded_tokenizer):
    """A special token takes no room where decoding skipped it (the default) and its text where
    it was kept; an echoed prompt's offsets count back from its end, so that a token the
    tokenizer added in front (BOS) leaves the prompt's own tokens where the echoed text has them."""
    tokens = render.TokenTable(embedded_tokenizer)
    end = embedded_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokens.is_special(end) and not tokens.is_special(embedded_tokenizer.encode("Hi")[0])
    ids = [*embedded_tokenizer.encode("Hi"), end, *embedded_tokenizer.encode(" there 🌍")]
    for skip, text in ((True, "Hi there 🌍"), (False, "Hi<|im_end|> there 🌍")):
        offsets, length = render.text_offsets(ids, tokens, skip_special=skip)
        assert length == len(text) and offsets == sorted(offsets)
        for i, offset in zip(ids, offsets):
            name = render.completion_token(tokens, i)
            assert name.startswith("bytes:") or (skip and i == end) or text.startswith(name, offset), (name, offset)

    prompt = "Say 🌍 now"
    prompt_ids = [end, *embedded_tokenizer.encode(prompt)]  # as a tokenizer adding BOS would
    entries = [TokenLogprobs(logprob=-0.5, rank=1, top_token_ids=[], top_logprobs=[]) for _ in prompt_ids]
    choice = render.Choice(text="", token_ids=[], logprobs=[], prompt_token_ids=prompt_ids,
                           prompt_logprobs=entries[1:])
    echo = render.echo_logprobs(choice, prompt, tokens)
    assert echo["text_offset"][0] == 0 and echo["text_offset"] == sorted(echo["text_offset"])
    for name, offset in zip(echo["tokens"][1:], echo["text_offset"][1:]):
        assert name.startswith("bytes:") or prompt.startswith(name, offset), (name, offset)


def test_a_body_sent_as_a_form_is_told_to_say_json():
    """`curl -d '{...}'` without -H 'Content-Type: application/json' sends a form, which FastAPI
    does not read as JSON: the 400 says what to send rather than that a dictionary was expected."""
    async def main():
        f, _ = await serving_frontend(CharTokenizer())
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(f, None)),
                                     base_url="http://frontend") as http:
            form = await http.post("/v1/completions", content=b'{"prompt": "hi"}',
                                   headers={"Content-Type": "application/x-www-form-urlencoded"})
            listed = await http.post("/v1/completions", json=["not", "an", "object"])
            untyped = await http.post("/v1/completions", content=b'["no", "Content-Type"]')
            return form, listed, untyped

    form, listed, untyped = asyncio.run(main())
    assert untyped.status_code == 400 and "Content-Type" not in untyped.json()["error"]["message"]  # read as JSON
    assert form.status_code == 400 and form.json()["error"]["message"] == (
        "body: send JSON with Content-Type: application/json (got application/x-www-form-urlencoded)")
    assert listed.status_code == 400 and "Content-Type" not in listed.json()["error"]["message"]  # JSON, not an object


def metaspace_tokenizer() -> Any:
    """A SentencePiece-style vocabulary (Llama 2, Mistral v0.x): words as "▁"-led pieces, emoji
    by byte fallback, a decoder that drops a lone token's leading space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["▁The", "▁cat", "▁sat", "▁", *(f"<0x{b:02X}>" for b in "🌍".encode())]
    model = models.Unigram([("<unk>", 0.0), *((p, -1.0) for p in pieces)], unk_id=0, byte_fallback=True)
    backend = Tokenizer(model)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Sequence([decoders.Metaspace(replacement="▁", prepend_scheme="first"),
                                         decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


def test_a_sentencepiece_vocabularys_tokens_keep_their_spaces():
    """Decoding "▁cat" alone gives "cat": its bytes (chat's `bytes`), its completions name and its
    text_offset must keep the space the text holds."""
    tokenizer = metaspace_tokenizer()
    tokens = render.TokenTable(tokenizer)
    ids = tokenizer.encode("The cat sat 🌍")
    assert tokenizer.convert_ids_to_tokens(ids)[:3] == ["▁The", "▁cat", "▁sat"] and tokenizer.decode([ids[1]]) == "cat"
    assert b"".join(tokens.raw(i) for i in ids) == " The cat sat 🌍".encode()  # the one prepended space too
    generated = ids[1:]  # as a continuation: the text holds each space
    text = " cat sat 🌍"
    offsets, end = render.text_offsets(generated, tokens)
    assert end == len(text) and [render.completion_token(tokens, i) for i in generated[:3]] == [" cat", " sat", " "]
    for i, offset in zip(generated, offsets):
        name = render.completion_token(tokens, i)
        assert name.startswith("bytes:") or text.startswith(name, offset), (name, offset)
    prompt = "The cat"  # an echo: the space the tokenizer prepended is not in the prompt's text
    choice = render.Choice(text="", prompt_token_ids=ids[:2], prompt_logprobs=[
        TokenLogprobs(logprob=-1.0, rank=1, top_token_ids=[], top_logprobs=[])])
    assert render.echo_logprobs(choice, prompt, tokens)["text_offset"] == [0, 3]
