"""Structured outputs at the frontend's doors, no model forward: refusals give their exact
status, param and message before anything is submitted; the compile runs off the event loop; the
compiled grammar is in the SubmitRequest that reaches the scheduler, and the backend is reported.
How each body form maps to its StructuredOutput: test_structured_request_bodies.py."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import grpc
import httpx
import pytest

from tests.support.fake_scheduler import FakeScheduler
from tests.support.frontends import serving_frontend
from vmesh.services.common.admission import InvalidRequest, admit
from vmesh.services.common.structured import GrammarCompiler
from vmesh.services.common.types import CompiledGrammar, ModelLimits, SamplingParams, StructuredOutput
from vmesh.services.common.wire.common import finish_from_proto
from vmesh.services.common.wire.public import output_to_public, request_from_public
from vmesh.services.common.wire.sampling import grammar_from_proto, structured_from_proto
from vmesh.services.frontend import structured_requests
from vmesh.services.frontend.core import FrontendCore
from vmesh.services.frontend.errors import RequestError
from vmesh.services.frontend.http_server import build_app
from vmesh.services.frontend.outbox import PendingOutput
from vmesh.services.frontend.structured_requests import BACKEND_HEADER
from vmesh.v1 import common_pb2, frontend_pb2

VOCAB_SIZE = 49152  # the embedded model's
LIMITS = ModelLimits("m", 4096, VOCAB_SIZE)
STOP = common_pb2.FINISH_REASON_STOP
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


class CharTokenizer:
    """One token per character; no chat template beyond joining the contents."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def apply_chat_template(self, messages: list[dict], **kwargs: Any) -> list[int]:
        return [ord(c) for m in messages for c in (m["content"] or "")]

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))


@pytest.fixture(scope="module")
def compiler(embedded_model_dir) -> GrammarCompiler:
    return GrammarCompiler(embedded_model_dir / "tokenizer.json", VOCAB_SIZE, [2])


# --- the request path: compile, submit, report -------------------------------------------------------


async def frontend(compiler: Any) -> tuple[FrontendCore, FakeScheduler]:
    f, scheduler = await serving_frontend(CharTokenizer(), FakeScheduler(LIMITS))
    f.grammar_compiler = compiler
    return f, scheduler


def finish(f: FrontendCore, text: str = '{"city": "Oslo"}') -> None:
    for key in list(f.outboxes):
        f.outboxes[key].put(PendingOutput(text=text, token_ids=[ord(c) for c in text],
                                          finish_reason=finish_from_proto(STOP)))


def post(f: FrontendCore, path: str, body: dict) -> Any:
    async def call() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(f, None)),
                                     base_url="http://frontend") as http:
            return await http.post(path, json=body)
    return asyncio.create_task(call())


@pytest.mark.parametrize("stream", [False, True])
def test_the_compiled_grammar_reaches_the_scheduler_and_the_backend_is_reported(compiler, stream: bool) -> None:
    async def main() -> None:
        f, scheduler = await frontend(compiler)
        call = post(f, "/v1/chat/completions", {
            "messages": CHAT, "stream": stream, "max_tokens": 20,
            "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}})
        await scheduler.until_submitted(1)
        finish(f)
        response = await call
        assert response.status_code == 200, response.text
        sampling = scheduler.submitted[0].sampling
        grammar = grammar_from_proto(sampling.grammar)
        assert grammar == compiler.compile(StructuredOutput("json_schema", json.dumps(SCHEMA)))
        assert grammar.backend == "xgrammar" and response.headers[BACKEND_HEADER] == "xgrammar"
        assert structured_from_proto(sampling.structured) == StructuredOutput("json_schema", json.dumps(SCHEMA))

    asyncio.run(main())


def test_an_unconstrained_request_carries_no_grammar_and_no_header(compiler) -> None:
    async def main() -> None:
        f, scheduler = await frontend(compiler)
        call = post(f, "/v1/completions", {"prompt": "hi", "max_tokens": 3})
        await scheduler.until_submitted(1)
        finish(f, "abc")
        response = await call
        assert response.status_code == 200 and BACKEND_HEADER not in response.headers
        assert not scheduler.submitted[0].sampling.HasField("grammar")

    asyncio.run(main())


def test_llguidance_named_by_the_client_is_the_backend_reported_over_grpc(compiler) -> None:
    async def main() -> None:
        f, scheduler = await frontend(compiler)
        request = frontend_pb2.GenerateRequest(text="hi")
        request.sampling.structured.CopyFrom(common_pb2.StructuredOutput(
            kind=common_pb2.STRUCTURED_KIND_REGEX, source="[ab]+", backend="llguidance"))
        stream = f.generate(request_from_public(request))
        first = asyncio.ensure_future(stream.__anext__())
        await scheduler.until_submitted(1)
        finish(f, "ab")
        response = output_to_public(await first)
        await stream.aclose()
        assert response.structured_output_backend == "llguidance"
        assert scheduler.submitted[0].sampling.grammar.backend == "llguidance"

    asyncio.run(main())


UNSUPPORTED = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                         "uniqueItems": True}}}
OVERSIZE = {"type": "string", "enum": [f"{i:0100}" for i in range(700)]}


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": UNSUPPORTED}}},
     "response_format.json_schema.schema",
     "response_format.json_schema.schema: properties.tags.uniqueItems: the JSON-schema keyword 'uniqueItems' is not "
     "supported by xgrammar"),
    ({"structured_outputs": {"json": {"type": "objekt"}}}, "structured_outputs.json",
     "structured_outputs.json: type: not a valid JSON schema ('objekt' is not valid under any of the given "
     "schemas)"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json",
     "structured_outputs.json: not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 "
     "(char 1))"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex", None),
    ({"structured_outputs": {"json": OVERSIZE}}, "structured_outputs.json",
     f"structured_outputs.json: the json_schema is {len(json.dumps(OVERSIZE))} bytes, over the 65536-byte limit"),
])
def test_compile_refusals_are_400s_naming_the_field_and_path_and_submit_nothing(compiler, body: dict, param: str,
                                                                                 message: str | None) -> None:
    async def main() -> None:
        f, scheduler = await frontend(compiler)
        response = await post(f, "/v1/chat/completions", {"messages": CHAT, **body})
        error = response.json()["error"]
        assert (response.status_code, error["param"], error["type"]) == (400, param, "invalid_request_error")
        if message is not None:
            assert error["message"] == message
        else:
            assert error["message"].startswith(f"{param}: ") and "cannot compile this regex" in error["message"]
        assert scheduler.submitted == []

    asyncio.run(main())


def test_a_forced_tool_whose_parameters_no_backend_enforces_is_a_400_naming_tools(compiler) -> None:
    async def main() -> None:
        f, scheduler = await frontend(compiler)
        tool = {"type": "function", "function": {"name": "tag", "parameters": UNSUPPORTED}}
        response = await post(f, "/v1/chat/completions", {"messages": CHAT, "tools": [tool], "tool_choice": "required"})
        error = response.json()["error"]
        assert (response.status_code, error["param"]) == (400, "tools")
        assert error["message"] == ("tools: $defs.vmesh_tool_0.properties.tags.uniqueItems: the JSON-schema keyword "
                                    "'uniqueItems' is not supported by xgrammar")
        assert scheduler.submitted == []

    asyncio.run(main())


def test_grpc_refusals_are_invalid_argument_naming_the_sampling_field(compiler) -> None:
    async def main() -> None:
        f, scheduler = await frontend(compiler)
        cases = []
        client_grammar = frontend_pb2.GenerateRequest(text="hi")
        client_grammar.sampling.grammar.CopyFrom(common_pb2.CompiledGrammar(backend="xgrammar", key="k", payload=b"{}"))
        cases.append((client_grammar, "sampling.grammar", "sampling.grammar: set by the frontend from "
                      "sampling.structured; a client may not send a compiled grammar"))
        unspecified = frontend_pb2.GenerateRequest(text="hi")
        unspecified.sampling.structured.source = "a"
        cases.append((unspecified, "sampling.structured.kind", "sampling.structured.kind: unspecified or unknown; "
                      "one of json_schema, json_object, regex, choice, grammar, structural_tag"))
        keyword = frontend_pb2.GenerateRequest(text="hi")
        keyword.sampling.structured.CopyFrom(common_pb2.StructuredOutput(
            kind=common_pb2.STRUCTURED_KIND_JSON_SCHEMA, source=json.dumps({"not": {"type": "string"}})))
        cases.append((keyword, "sampling.structured.source", "sampling.structured.source: not: the JSON-schema "
                      "keyword 'not' is not supported by xgrammar"))
        for request, field, message in cases:
            with pytest.raises(RequestError) as err:
                async for _ in f.generate(request_from_public(request)):
                    pass
            assert (err.value.code, err.value.field, err.value.message) == (grpc.StatusCode.INVALID_ARGUMENT, field,
                                                                             message)
        assert scheduler.submitted == []

    asyncio.run(main())


def test_admission_refuses_an_unknown_grammar_backend() -> None:
    params = SamplingParams(grammar=CompiledGrammar("outlines", "k", b"x"))
    with pytest.raises(InvalidRequest, match=r"^sampling.grammar.backend: 'outlines' is not one of xgrammar, "):
        admit([1], params, LIMITS)
    admit([1], SamplingParams(structured=StructuredOutput("regex", "a"), grammar=CompiledGrammar("xgrammar", "k",
                                                                                                 b"x")), LIMITS)


# --- compiling off the event loop ------------------------------------------------------------------


class BlockingCompiler:
    """Compiles nothing until `release` is set; says when a compile has started."""

    max_source_bytes = 1 << 16

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        self.started.set()
        assert self.release.wait(30), "never released"
        return CompiledGrammar("xgrammar", "key", b"payload")


def test_a_slow_compile_leaves_the_loop_serving_other_requests() -> None:
    async def main() -> None:
        blocking = BlockingCompiler()
        f, scheduler = await frontend(blocking)
        slow = post(f, "/v1/completions", {"prompt": "a", "max_tokens": 2, "structured_outputs": {"regex": "a+"}})
        await asyncio.get_running_loop().run_in_executor(None, blocking.started.wait)
        fast = post(f, "/v1/completions", {"prompt": "b", "max_tokens": 2})
        await scheduler.until_submitted(1)  # served while the compile still blocks
        assert not blocking.release.is_set() and not slow.done()
        assert list(scheduler.submitted[0].prompt_token_ids) == [ord("b")]
        finish(f, "ok")
        assert (await fast).status_code == 200
        blocking.release.set()
        await scheduler.until_submitted(2)
        assert scheduler.submitted[1].sampling.grammar.payload == b"payload"
        finish(f, "aa")
        response = await slow
        assert response.status_code == 200 and response.headers[BACKEND_HEADER] == "xgrammar"

    asyncio.run(main())


# --- building the compiler for the served model -----------------------------------------------------


def test_the_frontend_builds_its_compiler_from_the_model_dir(embedded_model_dir, embedded_tokenizer) -> None:
    assert structured_requests.model_stop_token_ids(embedded_model_dir, embedded_tokenizer) == [2]
    built = structured_requests.build_compiler(embedded_tokenizer, LIMITS, embedded_model_dir)
    assert built is not None and built.vocabulary.vocab_size == VOCAB_SIZE and built.vocabulary.stop_token_ids == (2,)
    assert structured_requests.build_compiler(CharTokenizer(), LIMITS, None) is None


def test_a_compile_past_its_budget_is_a_400_naming_the_budget(embedded_model_dir) -> None:
    release = threading.Event()

    class Stuck(GrammarCompiler):
        def compile_uncached(self, spec: StructuredOutput) -> CompiledGrammar:
            release.wait(30)
            return super().compile_uncached(spec)

    async def main() -> None:
        f, scheduler = await frontend(Stuck(embedded_model_dir / "tokenizer.json", VOCAB_SIZE, [2], time_budget_s=0))
        try:
            response = await post(f, "/v1/completions", {"prompt": "a", "structured_outputs": {"regex": "a+"}})
        finally:
            release.set()
        assert response.status_code == 400
        assert response.json()["error"] == {
            "message": "structured_outputs.regex: compiling the grammar took longer than its 0 s budget",
            "type": "invalid_request_error", "param": "structured_outputs.regex", "code": None}
        assert scheduler.submitted == []

    asyncio.run(main())


@pytest.mark.parametrize("named", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_choice_is_submitted_with_its_grammar_and_answered_as_tool_calls(compiler, stream: bool,
                                                                                      named: bool):
    """"required" ends with finish_reason "tool_calls"; a named function with "stop" (OpenAI's and
    vLLM's answer where the request chose the function)."""
    ends = "stop" if named else "tool_calls"
    choice = {"type": "function", "function": {"name": "get_weather"}} if named else "required"

    async def main() -> None:
        f, scheduler = await frontend(compiler)
        call = post(f, "/v1/chat/completions", {"messages": CHAT, "tools": [WEATHER], "tool_choice": choice,
                                                "stream": stream})
        await scheduler.until_submitted(1)
        finish(f, '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]')
        response = await call
        assert response.status_code == 200 and response.headers[BACKEND_HEADER] == "xgrammar"
        assert scheduler.submitted[0].sampling.grammar.backend == "xgrammar"
        if stream:
            chunks = [json.loads(line.removeprefix("data: ")) for line in response.text.splitlines()
                      if line.startswith("data: {")]
            deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
            names = [d["tool_calls"][0]["function"]["name"] for d in deltas if d.get("tool_calls")
                     and "name" in d["tool_calls"][0]["function"]]
            arguments = "".join(d["tool_calls"][0]["function"].get("arguments", "") for d in deltas
                                if d.get("tool_calls"))
            assert names == ["get_weather"] and json.loads(arguments) == {"city": "Oslo"}
            assert chunks[-1]["choices"][0]["finish_reason"] == ends
        else:
            [tool_call] = response.json()["choices"][0]["message"]["tool_calls"]
            assert tool_call["function"]["name"] == "get_weather"
            assert json.loads(tool_call["function"]["arguments"]) == {"city": "Oslo"}
            assert response.json()["choices"][0]["finish_reason"] == ends

    asyncio.run(main())


def test_the_responses_api_text_format_is_compiled_and_its_refusals_name_text_format(compiler) -> None:
    async def main() -> None:
        f, scheduler = await frontend(compiler)
        response = await post(f, "/v1/responses", {"input": "hi", "text": {"format": {
            "type": "json_schema", "name": "t", "schema": UNSUPPORTED}}})
        assert response.status_code == 400 and scheduler.submitted == []
        assert response.json()["error"]["param"] == "text.format.schema"
        assert response.json()["error"]["message"] == (
            "text.format.schema: properties.tags.uniqueItems: the JSON-schema keyword 'uniqueItems' is not supported "
            "by xgrammar")
        call = post(f, "/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "c",
                                                                            "schema": SCHEMA}}})
        await scheduler.until_submitted(1)
        finish(f)
        assert (await call).status_code == 200
        assert grammar_from_proto(scheduler.submitted[0].sampling.grammar) == compiler.compile(
            StructuredOutput("json_schema", json.dumps(SCHEMA)))

    asyncio.run(main())
