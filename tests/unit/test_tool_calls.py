"""Tool calling on chat completions without a mesh: the request's tool fields and their 400s, the
chat template's tools (the model's own, or the built-in Hermes-style prompt), the schema forced
calls are held to, the incremental parsers (the same result however the text is split), and the
HTTP layer's streamed and non-streamed tool calls through the real `openai` client."""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.frontends import chat_completion, openai_client, serving_frontend
from tests.unit.test_openai_http import CharTokenizer, emit
from vmesh.services.common.generation import Chat
from vmesh.services.common.tokenizer import ChatTokenizer, encode_chat, template_supports_tools
from vmesh.services.common.tool_prompt import tool_call_text
from vmesh.services.frontend import openai_protocol as oai
from vmesh.services.frontend.errors import RequestError
from vmesh.services.frontend.tool_calls import ToolPlan, check_tools, tool_choice_schema, tool_plan
from vmesh.services.frontend.tool_parsers import (
    ContentDelta,
    HermesToolCallParser,
    JsonToolCallParser,
    ToolCallDelta,
    assemble,
    parse_text,
)
from vmesh.v1 import common_pb2

STOP = common_pb2.FINISH_REASON_STOP
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city"], "additionalProperties": False}}}
TREE = {"type": "function", "function": {
    "name": "plant", "parameters": {
        "type": "object", "$defs": {"node": {"type": "object", "properties": {
            "label": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
            "required": ["label"], "additionalProperties": False}},
        "properties": {"root": {"$ref": "#/$defs/node"}}, "required": ["root"], "additionalProperties": False}}}
HI = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> oai.ChatCompletionRequest:
    return oai.ChatCompletionRequest(**{"messages": HI, **fields})


def refused_param(**fields: Any) -> str | None:
    with pytest.raises(RequestError) as err:
        oai.chat_request(chat(**fields), "m")
    return oai.request_error_body(err.value)[1]["error"]["param"]


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}]},
     "tools[0].function.parameters.properties"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"functions": [{"name": "f"}], "tools": [WEATHER]}, "functions"),
    ({"functions": [{"name": "f"}], "function_call": {"name": "g"}}, "function_call.name"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1", "function": {}}]}]},
     "messages[0].tool_calls[0].function.name"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": {}}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}]},
     "messages[0].tool_calls"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].name"),
])
def test_tool_fields_are_checked_and_refusals_name_the_field(fields, param):
    assert refused_param(**fields) == param


def test_tools_and_history_reach_the_chat_input():
    history = [*HI, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}]
    prompt = oai.chat_request(chat(messages=history, tools=[WEATHER], parallel_tool_calls=False), "m").prompt
    assert isinstance(prompt, Chat)
    assert json.loads(prompt.tools) == [WEATHER]
    call = prompt.messages[1].tool_calls[0]
    assert (call.id, call.name, json.loads(call.arguments)) == ("call_1", "get_weather", {"city": "Oslo"})
    assert (prompt.messages[2].role, prompt.messages[2].tool_call_id) == ("tool", "call_1")
    # "none": the model is not to call, so the prompt shows no tools (the history still renders)
    silent = oai.chat_request(chat(messages=history, tools=[WEATHER], tool_choice="none"), "m").prompt
    assert isinstance(silent, Chat) and silent.tools == ""
    legacy = tool_plan(None, None, None, [WEATHER["function"]], "auto")
    assert legacy == ToolPlan((WEATHER,), "auto", parallel=False, legacy=True)


SMOL_LIKE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOLS_AWARE = ("{% if tools %}TOOLS={{ tools | tojson }}\n{% endif %}{% for m in messages %}{{ m.role }}:"
               "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }} "
               "{{ c.function.arguments | tojson }};{% endfor %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}")
HISTORY = [{"role": "system", "content": "Be brief."}, *HI,
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
               {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
           {"role": "tool", "tool_call_id": "c1", "content": "-3 C"},
           {"role": "tool", "tool_call_id": "c2", "content": "18 C"}]


def test_a_template_without_tools_gets_the_built_in_tool_prompt(embedded_model_dir, embedded_tokenizer):
    lean = ChatTokenizer.load(embedded_model_dir)
    assert not lean.supports_tools  # SmolLM2's ChatML template
    text = lean.render_chat(HISTORY, tools=[WEATHER])
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and json.dumps(WEATHER) in system
    assert "<tools>" in system and "<tool_call>" in system
    assert tool_call_text("get_weather", {"city": "Oslo"}) + "\n" + tool_call_text("get_weather", {"city": "Rome"}) \
        in text
    # both results in one user turn, in order
    assert "<|im_start|>user\n<tool_response>\n-3 C\n</tool_response>\n<tool_response>\n18 C\n</tool_response>" \
        "<|im_end|>" in text
    # transformers' tokenizer (the other door) gets the same prompt
    assert encode_chat(embedded_tokenizer, HISTORY, [WEATHER]) == encode_chat(lean, HISTORY, [WEATHER])
    assert lean.render_chat(HI) == lean.render_chat(HI, tools=None)  # no tools: the template's own rendering


def test_a_template_that_reads_tools_gets_them_as_transformers_passes_them(embedded_model_dir, embedded_tokenizer):
    assert template_supports_tools(TOOLS_AWARE) and not template_supports_tools(SMOL_LIKE)
    lean = ChatTokenizer(ChatTokenizer.load(embedded_model_dir).backend_tokenizer, TOOLS_AWARE, {})
    text = lean.render_chat(HISTORY, add_generation_prompt=False, tools=[WEATHER])
    assert text.startswith(f"TOOLS={json.dumps([WEATHER])}\n") and "<tools>" not in text
    assert 'CALL get_weather {"city": "Oslo"};CALL get_weather {"city": "Rome"};' in text  # arguments as values
    assert text.endswith("tool:-3 Ctool:18 C")  # trim_blocks, as transformers renders
    expected = embedded_tokenizer.apply_chat_template(
        [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                              for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in HISTORY],
        tools=[WEATHER], chat_template=TOOLS_AWARE, tokenize=False, add_generation_prompt=False)
    assert text == expected


def test_forced_calls_schema_holds_every_call_to_its_tools_parameters():
    tools = check_tools([WEATHER, TREE])
    assert tool_choice_schema(tools, "auto") is None and tool_choice_schema(tools, "none") is None
    required = tool_choice_schema(tools, "required")
    one = tool_choice_schema(tools, "required", parallel_tool_calls=False)
    named = tool_choice_schema(tools, "plant")
    for schema in (required, one, named):
        assert schema is not None
        jsonschema.Draft202012Validator.check_schema(schema)
    weather = {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}
    tree = {"name": "plant", "arguments": {"root": {"label": "a", "children": [{"label": "b", "children": []}]}}}
    valid = jsonschema.Draft202012Validator(required).is_valid
    assert valid([weather, tree]) and valid([tree])
    assert not valid([]) and not valid([{"name": "get_weather", "arguments": {"unit": "c"}}])
    assert not valid([{"name": "plant", "arguments": {"root": {"label": "a", "children": [{"x": 1}]}}}])  # via $ref
    assert not valid([{**weather, "extra": 1}]) and not valid([{"name": "nope", "arguments": {}}])
    assert jsonschema.Draft202012Validator(one).is_valid([weather])
    assert not jsonschema.Draft202012Validator(one).is_valid([weather, weather])
    assert jsonschema.Draft202012Validator(named).is_valid([tree])
    assert not jsonschema.Draft202012Validator(named).is_valid([weather])
    assert not jsonschema.Draft202012Validator(named).is_valid([tree, tree])


def test_forced_calls_schema_compiles_with_xgrammar():
    xgrammar = pytest.importorskip("xgrammar")
    schema = tool_choice_schema(check_tools([WEATHER, TREE]), "required")
    assert "get_weather" in str(xgrammar.Grammar.from_json_schema(json.dumps(schema)))


def split_feed(parser: Any, text: str, cuts: list[int]) -> list[Any]:
    deltas: list[Any] = []
    bounds = [0, *sorted(set(cuts)), len(text)]
    for a, b in itertools.pairwise(bounds):
        deltas += parser.feed(text[a:b])
    return deltas + parser.finish()


def ids() -> Any:
    count = iter(range(1 << 30))
    return lambda: f"call_{next(count)}"


def check_split_invariance(make: Any, text: str, cuts: list[int] | None = None) -> tuple[str, list[dict]]:
    """Every split of `text` (at each one position, and at `cuts`) assembles to the same message."""
    whole = assemble(split_feed(make(), text, []))
    for cut in range(len(text) + 1):
        assert assemble(split_feed(make(), text, [cut])) == whole, cut
    if cuts is not None:
        assert assemble(split_feed(make(), text, cuts)) == whole
    return whole


def hermes() -> HermesToolCallParser:
    return HermesToolCallParser(["get_weather", "plant"], new_id=ids())


def test_hermes_calls_between_text_and_malformed_blocks_staying_content():
    text = ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call> and '
            '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "plant", "arguments": "{\\"root\\": {\\"label\\": \\"x\\"}}"}</tool_call>\n')
    content, calls = check_split_invariance(hermes, text)
    assert content == ('I will check.<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call> and '
                       '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>')
    assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("call_0", "get_weather", {"city": "Oslo"}), ("call_1", "plant", {"root": {"label": "x"}})]
    assert parse_text(hermes(), '<tool_call>{"name": "get_weather"}</tool_call>')[0] is None  # only calls: null
    for plain in ("no calls at all  \n", "  <tool_", "<tool_call>{never closed", "a <tool_call>x</tool_call> b\n"):
        assert check_split_invariance(hermes, plain) == (plain, [])  # nothing dropped


def test_hermes_streams_a_call_as_its_first_delta_then_its_arguments():
    deltas = split_feed(hermes(), 'Hi <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
                        [5, 20])
    assert deltas == [ContentDelta("Hi"), ToolCallDelta(0, "", "call_0", "get_weather"),
                      ToolCallDelta(0, '{"city": "Oslo"}')]


SEGMENT = st.one_of(
    st.text(alphabet="ab <>/_{}\n\"tolcaj", max_size=12).map(lambda t: ("text", t)),
    st.sampled_from([{"city": "Oslo"}, {}, {"city": "</tool_call>"}, {"city": "<tool_call>\\"}]).map(
        lambda a: ("call", a)),
    st.sampled_from(["{", '{"name": "get_weather", "arguments": [1]}', "", '{"name": 1}']).map(lambda b: ("bad", b)))


@settings(max_examples=150, deadline=None)
@given(st.lists(SEGMENT, max_size=6), st.lists(st.integers(0, 400), max_size=8))
def test_hermes_output_is_the_same_however_it_is_split(segments, cuts):
    parts, expected = [], []
    for kind, value in segments:
        if kind == "text":
            parts.append(value)
        elif kind == "call":
            parts.append(tool_call_text("get_weather", value))
            expected.append(value)
        else:
            parts.append(f"<tool_call>{value}</tool_call>")
    text = "".join(parts)
    content, calls = check_split_invariance(hermes, text, [c for c in cuts if c <= len(text)])
    # every call made of a well-formed block is found unless text around it fused it with another tag
    if "<tool_call>" not in "".join(v for k, v in segments if k == "text") and \
            "</tool_call>" not in "".join(v for k, v in segments if k == "text"):
        assert [json.loads(c["function"]["arguments"]) for c in calls] == expected
    if not calls:
        assert content == text


ARGUMENTS = st.recursive(st.none() | st.booleans() | st.integers() | st.text(alphabet='a"\\}{] ,:é', max_size=5),
                         lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                                      max_size=3), max_leaves=8)
CALLS = st.lists(st.tuples(st.sampled_from(["get_weather", "plant", 'we"ird']),
                           st.dictionaries(st.text(alphabet='ab"{}', max_size=3), ARGUMENTS, max_size=3)),
                 min_size=1, max_size=3)


@settings(max_examples=150, deadline=None)
@given(CALLS, st.sampled_from([None, 2]), st.booleans(), st.lists(st.integers(0, 600), max_size=8))
def test_forced_output_parses_to_its_calls_however_it_is_split(calls, indent, arguments_first, cuts):
    items = [{"arguments": a, "name": n} if arguments_first else {"name": n, "arguments": a} for n, a in calls]
    text = json.dumps(items, indent=indent)
    content, parsed = check_split_invariance(lambda: JsonToolCallParser(new_id=ids()), text,
                                             [c for c in cuts if c <= len(text)])
    assert content == ""
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed] == calls


def test_forced_output_streams_arguments_as_written_and_keeps_a_truncated_call():
    parser = JsonToolCallParser(new_id=ids())
    deltas = split_feed(parser, '[{"name": "get_weather", "arguments": {"city": "Os', [30, 40])
    assert deltas[0] == ToolCallDelta(0, "", "call_0", "get_weather")
    assert assemble(deltas)[1][0]["function"]["arguments"] == '{"city": "Os'
    assert parse_text(JsonToolCallParser(), 'not json')[0] == "not json"  # outside the shape: content


SCRIPT = ['Checking. <tool', '_call>\n{"name": "get_weather", "argu', 'ments": {"city": "Oslo"}}\n</tool_call>',
          '\n<tool_call>{"name": "get_weather", "arguments": {"city": "Rome", "unit": "c"}}</tool_call>']


def scripted_chat(body: dict[str, Any], stream: bool) -> tuple[Any, list[int]]:
    """The chat completion the openai client gets for `body` when the model writes SCRIPT, and
    the prompt the frontend submitted."""
    async def main() -> tuple[Any, list[int]]:
        f, scheduler = await serving_frontend(CharTokenizer())
        client = openai_client(f)
        task = asyncio.create_task(chat_completion(client, {"model": "m", "messages": HI, "max_tokens": 200,
                                                            **body}, stream))
        await scheduler.until_submitted(1)
        for piece in SCRIPT[:-1]:
            emit(f, piece)
        emit(f, SCRIPT[-1], STOP)
        result = await task
        await client.close()
        return result, list(scheduler.submitted[0].prompt_token_ids)

    return asyncio.run(main())


@pytest.mark.parametrize("stream", [False, True])
def test_http_tool_calls_assemble_to_the_same_message_through_the_openai_client(stream):
    completion, prompt = scripted_chat({"tools": [WEATHER]}, stream)
    assert "<tools>" in "".join(map(chr, prompt))  # CharTokenizer's template knows no tools: the built-in prompt
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    calls = choice.message.tool_calls
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("function", "get_weather", {"city": "Oslo"}), ("function", "get_weather", {"city": "Rome", "unit": "c"})]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("form", ["parallel_tool_calls_false", "legacy_functions"])
def test_one_call_at_most_and_the_legacy_shape_through_the_openai_client(stream, form):
    """parallel_tool_calls false under "auto": the model wrote two calls, the first is the answer
    (no grammar holds "auto" to one). The legacy `functions` are answered as OpenAI answered them:
    the message's one function_call, finish_reason "function_call"."""
    body: dict[str, Any] = ({"functions": [WEATHER["function"]]} if form == "legacy_functions"
                            else {"tools": [WEATHER], "parallel_tool_calls": False})
    choice = scripted_chat(body, stream)[0].choices[0]
    assert choice.message.content == "Checking."
    if form == "legacy_functions":
        assert choice.finish_reason == "function_call" and not choice.message.tool_calls
        call = choice.message.function_call
        assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Oslo"})
    else:
        assert choice.finish_reason == "tool_calls" and choice.message.function_call is None
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
            ("get_weather", {"city": "Oslo"})]
