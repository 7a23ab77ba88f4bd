"""The Responses API (POST /v1/responses) without a network or a mesh: its translation into the
chat request that serves it, the Response object and the streamed events built from chat's
body and chunks, and the route driven through the ASGI app by the real `openai` client (strict
validation: every field its models require is there) over a fake scheduler, the test playing
the detokenizer."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx2
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from tests.support.eventually import eventually
from tests.support.frontends import serving_frontend
from tests.unit.test_openai_http import Call, CharTokenizer
from vmesh.services.common.generation import Chat
from vmesh.services.common.types import FinishReason, OutputBatch, StreamOutput
from vmesh.services.frontend import responses_api as api
from vmesh.services.frontend.core import FrontendCore
from vmesh.services.frontend.errors import RequestError
from vmesh.services.frontend.http_server import build_app
from vmesh.services.frontend.responses_events import ResponseEvents

EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)


def request(**fields: Any) -> api.ResponsesRequest:
    return api.ResponsesRequest.model_validate({"input": "hi", **fields})


def refusal(**fields: Any) -> RequestError:
    with pytest.raises(RequestError) as caught:
        api.translate(request(**fields), "m")
    return caught.value


def test_instructions_and_input_become_chat_messages_in_order():
    chat, _ = api.chat_body(request(instructions="Be brief.", input=[
        {"role": "developer", "content": "Use French."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                         {"type": "input_text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{\"x\": 1}"},
        {"type": "function_call", "call_id": "call_2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "42"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "ok"}]},
    ], max_output_tokens=7, temperature=0, top_p=0.5))
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Use French."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}], "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}},
            {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
        {"role": "tool", "tool_call_id": "call_2", "content": "ok"},
    ]
    assert (chat["max_completion_tokens"], chat["temperature"], chat["top_p"]) == (7, 0, 0.5)


def test_a_string_input_is_one_user_message_served_as_chat_serves_it():
    generate, view, _ = api.translate(request(instructions="sys", input="hello", max_output_tokens=5), "m")
    assert isinstance(generate.prompt, Chat)
    assert [(m.role, m.content) for m in generate.prompt.messages] == [("system", "sys"), ("user", "hello")]
    assert generate.sampling.max_tokens == 5 and view.model == "m"


def test_text_format_and_function_tools_take_chat_shapes():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    chat, _ = api.chat_body(request(
        text={"format": {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}},
        tools=[{"type": "function", "name": "f", "description": "d", "parameters": schema, "strict": True}],
        tool_choice={"type": "function", "name": "f"}, parallel_tool_calls=False))
    assert chat["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "thing", "schema": schema, "strict": True}}
    assert chat["tools"] == [{"type": "function", "function": {"name": "f", "description": "d",
                                                               "parameters": schema, "strict": True}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["parallel_tool_calls"] is False
    assert api.chat_body(request(text={"format": {"type": "json_object"}}))[0]["response_format"] == {
        "type": "json_object"}
    assert "response_format" not in api.chat_body(request(text={"format": {"type": "text"}}))[0]
    assert api.chat_body(request(tool_choice="required"))[0]["tool_choice"] == "required"


@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "keeps no responses"),
    ({"conversation": "conv_1"}, "conversation", "keeps no responses"),
    ({"background": True}, "background", "not supported"),
    ({"reasoning": {"effort": "high"}}, "reasoning", "not supported"),
    ({"include": ["reasoning.encrypted_content"]}, "include", "not supported"),
    ({"truncation": "auto"}, "truncation", "only 'disabled'"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "only function tools"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice", "not supported"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format.type", "not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type", "only text parts"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "keeps no responses"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type", "not supported"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "not supported"),
    ({"input": None}, "input", "required"),
])
def test_unsupported_fields_are_refused_naming_them(fields, param, says):
    exc = refusal(**fields)
    assert exc.field == param and exc.message.startswith(f"{param}: ") and says in exc.message


@pytest.mark.parametrize(("fields", "param"), [
    ({"instructions": "\ud800"}, "instructions"),
    ({"input": "\ud800"}, "input"),
    ({"input": [{"role": "user", "content": "ok"}, {"role": "user", "content": [
        {"type": "input_text", "text": "\ud800"}]}]}, "input[1].content[0].text"),
    ({"max_output_tokens": -1}, "max_output_tokens"),
])
def test_what_chat_refuses_is_named_as_the_responses_request_names_it(fields, param):
    exc = refusal(**fields)
    assert exc.field == param and exc.message.startswith(f"{param}: ")


def test_store_user_metadata_are_accepted_and_the_response_echoes_the_request():
    body = request(store=True, user="u", metadata={"k": "v"}, instructions="sys", max_output_tokens=9,
                   temperature=0.5, tools=[{"type": "function", "name": "f", "parameters": {}}])
    view = api.translate(request(store=True, user="u", metadata={"k": "v"}), "m")[1]
    assert view.body.metadata == {"k": "v"}
    response = api.ResponsesView(body, "m").from_chat(chat_completion("hello", "stop"))
    Response.model_validate(response)  # every field the client's model requires
    assert {k: response[k] for k in ("instructions", "max_output_tokens", "temperature", "top_p", "metadata",
                                     "tool_choice", "parallel_tool_calls", "store")} == {
        "instructions": "sys", "max_output_tokens": 9, "temperature": 0.5, "top_p": 1.0, "metadata": {"k": "v"},
        "tool_choice": "auto", "parallel_tool_calls": True, "store": False}
    assert response["tools"] == body.tools and response["text"] == {"format": {"type": "text"}}


def chat_completion(content: str | None, finish: str, tool_calls: list[dict] | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls is not None:
        message["tool_calls"] = tool_calls
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14,
                      "prompt_tokens_details": {"cached_tokens": 4}}}


CALLS = [{"id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}},
         {"id": "call_b", "type": "function", "function": {"name": "g", "arguments": "{}"}}]


def test_a_chat_body_becomes_a_response_with_items_and_usage():
    view = api.ResponsesView(request(), "m")
    done = Response.model_validate(view.from_chat(chat_completion("Hi!", "stop")))
    assert done.status == "completed" and done.incomplete_details is None and done.output_text == "Hi!"
    assert done.output[0].id == view.message_id and done.id.startswith("resp_")
    assert done.usage.model_dump() == {"input_tokens": 11, "output_tokens": 3, "total_tokens": 14,
                                       "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0,
                                                                "cache_write_tokens_details": None},
                                       "output_tokens_details": {"reasoning_tokens": 0}}
    cut = Response.model_validate(view.from_chat(chat_completion("Hi", "length")))
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output[0].status == "incomplete"
    called = Response.model_validate(view.from_chat(chat_completion(None, "tool_calls", CALLS)))
    assert [(i.type, i.call_id, i.name, i.arguments, i.status) for i in called.output] == [
        ("function_call", "call_a", "f", "{\"x\": 1}", "completed"),
        ("function_call", "call_b", "g", "{}", "completed")]
    both = Response.model_validate(view.from_chat(chat_completion("Let me see.", "tool_calls", CALLS[:1])))
    assert [i.type for i in both.output] == ["message", "function_call"]


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, usage: dict | None = None) -> dict:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": choices,
            **({"usage": usage} if usage else {})}


USAGE = chat_completion("", "stop")["usage"]


def streamed(chunks: list[dict]) -> tuple[list[dict], api.ResponsesView]:
    view = api.ResponsesView(request(), "m")
    events = ResponseEvents(view)
    out = list(events.start())
    for c in chunks:
        out += events.chunk(c)
    out += events.finish()
    for event in out:
        EVENTS.validate_python(event)  # each is one of the client's event models, whole
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out, view


def test_streamed_text_is_one_message_item_and_its_final_response_equals_the_unstreamed_one():
    events, view = streamed([chunk({"role": "assistant", "content": ""}), chunk({"content": "Hi"}),
                             chunk({"content": "!"}, "stop"), chunk(usage=USAGE)])
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["delta"] for e in events if e["type"] == "response.output_text.delta"] == ["Hi", "!"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert events[4]["item_id"] == view.message_id and events[4]["output_index"] == 0
    assert events[6]["text"] == "Hi!"
    assert events[-1]["response"] == view.from_chat(chat_completion("Hi!", "stop"))


def test_a_streamed_length_finish_is_incomplete():
    events, view = streamed([chunk({"content": "Hi"}, "length"), chunk(usage=USAGE)])
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"] == view.from_chat(chat_completion("Hi", "length"))
    assert events[-2]["item"]["status"] == "incomplete"


def test_streamed_tool_calls_are_function_call_items_whose_arguments_assemble():
    events, view = streamed([
        chunk({"role": "assistant", "content": ""}), chunk({"content": "Let me see."}),
        chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                               "function": {"name": "f", "arguments": ""}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{\"x\""}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}),
        chunk({"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                               "function": {"name": "g", "arguments": "{}"}}]}, "tool_calls"),
        chunk(usage=USAGE)])
    assert [e["type"] for e in events][2:] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e["arguments"] for e in events if e["type"] == "response.function_call_arguments.done"] == [
        "{\"x\": 1}", "{}"]
    final = events[-1]["response"]
    expected = view.from_chat(chat_completion("Let me see.", "tool_calls", CALLS))
    for item, fc in zip(final["output"][1:], expected["output"][1:]):
        assert item["id"].startswith("fc_")
        item["id"] = fc["id"]  # the one field each rendering draws afresh
    assert final == expected


def test_a_stream_that_says_nothing_has_an_empty_message_as_the_unstreamed_response():
    events, view = streamed([chunk({"role": "assistant", "content": ""}), chunk({}, "stop"), chunk(usage=USAGE)])
    assert events[-1]["response"] == view.from_chat(chat_completion("", "stop"))


# Through the app, with the real client.

def emit(f: FrontendCore, text: str, finish: FinishReason | None = None, usage: tuple[int, int] = (0, 0)) -> None:
    """Play the detokenizer (one token per character); `usage`: the finished request's prompt and
    completion tokens."""
    f.dispatch(OutputBatch([StreamOutput(key, text, [ord(c) for c in text], finish, *usage, 0) for key in f.outboxes]))


def client(f: FrontendCore) -> openai.AsyncOpenAI:
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=build_app(f, None)), base_url="http://frontend")
    return openai.AsyncOpenAI(base_url="http://frontend/v1", api_key="none", http_client=http, max_retries=0,
                              _strict_response_validation=True)


async def submitted(scheduler: Any, n: int, call: asyncio.Task) -> None:
    """Wait for the n-th submission, or for `call` to fail before it."""
    waiting = asyncio.ensure_future(scheduler.until_submitted(n))
    await asyncio.wait([waiting, call], return_when=asyncio.FIRST_COMPLETED)
    if not waiting.done():
        waiting.cancel()
        call.result()  # raises what the call failed with
        raise AssertionError("the call ended without submitting")


def test_the_openai_client_creates_and_streams_responses_through_the_app():
    async def main():
        f, scheduler = await serving_frontend(CharTokenizer())
        oai_client = client(f)
        made = asyncio.create_task(oai_client.responses.create(input="hi", instructions="sys", max_output_tokens=5))
        await submitted(scheduler, 1, made)
        emit(f, "Hello", FinishReason.LENGTH, usage=(5, 5))
        done = await made
        assert list(scheduler.submitted[0].prompt_token_ids) == [ord(c) for c in "syshi"]  # instructions first
        assert done.status == "incomplete" and done.output_text == "Hello"
        assert done.incomplete_details.reason == "max_output_tokens"
        assert (done.usage.input_tokens, done.usage.output_tokens, done.usage.total_tokens) == (5, 5, 10)

        async def stream() -> tuple[list[str], Response]:
            async with oai_client.responses.stream(model=f.loaded_limits().name, input="hi") as events:
                kinds = [e.type async for e in events]
                return kinds, await events.get_final_response()

        running = asyncio.create_task(stream())
        await submitted(scheduler, 2, running)
        emit(f, "He")
        emit(f, "llo", FinishReason.STOP, usage=(2, 5))
        kinds, final = await running
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        assert kinds.count("response.output_text.delta") >= 1
        assert final.status == "completed" and final.output_text == "Hello" and final.usage.total_tokens == 7

        with pytest.raises(openai.BadRequestError) as refused:
            await oai_client.responses.create(input="hi", previous_response_id="resp_1")
        assert refused.value.body["param"] == "previous_response_id"
        assert "keeps no responses" in refused.value.body["message"]
        await oai_client.close()

    asyncio.run(main())


def test_a_request_aborted_mid_stream_ends_with_an_error_event():
    async def main():
        f, scheduler = await serving_frontend(CharTokenizer())
        call = Call(build_app(f, None), "/v1/responses", {"input": "hi", "stream": True})
        await scheduler.until_submitted(1)
        emit(f, "a")
        await eventually(lambda: call.status is not None)  # started: the abort comes mid-stream
        emit(f, "", FinishReason.ABORT)
        await call.task
        return call

    call = asyncio.run(main())
    assert call.status == 200
    events = [json.loads(e) for e in call.events()]
    assert [line.removeprefix("event: ") for line in call.body.splitlines() if line.startswith("event: ")] == [
        e["type"] for e in events]
    assert [e["type"] for e in events][-2:] == ["response.output_text.delta", "error"]
    assert events[-1]["code"] == "service_unavailable_error" and events[-1]["sequence_number"] == len(events) - 1
    assert "[DONE]" not in call.body
