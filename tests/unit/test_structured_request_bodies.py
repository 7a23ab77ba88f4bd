"""Structured outputs in the OpenAI request bodies, no model and no compile: each body form
(OpenAI's response_format, vLLM's structured_outputs, a forced tool choice) becomes the right
StructuredOutput, and a malformed one is a 400 naming its field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from vmesh.services.common.types import StructuredOutput
from vmesh.services.frontend import openai_protocol as oai
from vmesh.services.frontend.errors import RequestError

CHAT = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def chat_spec(**body: Any) -> StructuredOutput | None:
    request = oai.chat_request(oai.ChatCompletionRequest(messages=CHAT, **body), "m")
    return request.sampling.structured


def completion_spec(**body: Any) -> StructuredOutput | None:
    [request] = oai.completion_requests(oai.CompletionRequest(prompt="hi", **body), "m")
    return request.sampling.structured


# --- each body form maps to its StructuredOutput ----------------------------------------------------


@pytest.mark.parametrize(("body", "expected"), [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}},
     StructuredOutput("json_schema", json.dumps(SCHEMA))),
    # strict: false is served the same way: the whole schema is enforced.
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": False,
                                                                 "description": "a city"}}},
     StructuredOutput("json_schema", json.dumps(SCHEMA))),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput("json_schema", json.dumps(SCHEMA))),
    ({"structured_outputs": {"json": '{"type": "integer"}'}}, StructuredOutput("json_schema", '{"type": "integer"}')),
    ({"structured_outputs": {"regex": r"\d{3}"}}, StructuredOutput("regex", r"\d{3}")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutput("choice", '["yes", "no"]')),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, StructuredOutput("grammar", 'root ::= "a"')),
    ({"structured_outputs": {"json_object": True}}, StructuredOutput("json_object")),
    ({"structured_outputs": {"structural_tag": {"type": "structural_tag"}, "backend": "xgrammar"}},
     StructuredOutput("structural_tag", '{"type": "structural_tag"}', "xgrammar")),
    ({"structured_outputs": {"regex": "a+", "backend": "llguidance"}}, StructuredOutput("regex", "a+", "llguidance")),
])
def test_each_body_form_maps_to_its_structured_output(body: dict, expected: StructuredOutput | None) -> None:
    assert chat_spec(**body) == expected
    assert completion_spec(**body) == expected


def test_a_forced_tool_choice_is_its_calls_schema() -> None:
    from vmesh.services.frontend import tool_calls

    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        body = oai.ChatCompletionRequest(messages=CHAT, tools=[WEATHER], tool_choice=choice)
        plan = oai.chat_tools(body)
        spec = oai.chat_request(body, "m", plan).sampling.structured
        assert spec == StructuredOutput("json_schema", json.dumps(tool_calls.plan_schema(plan)))
    assert chat_spec(tools=[WEATHER], tool_choice="auto") is None


# --- refusals of the body, before anything is compiled ----------------------------------------------


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w"}}}, "response_format.json_schema.schema",
     "response_format.json_schema.schema: required"),
    ({"response_format": {"type": "xml"}}, "response_format.type",
     "response_format.type: 'xml' is not one of text, json_object, json_schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "structured_outputs: exactly one of json, regex, choice, grammar, structural_tag, json_object is required, "
     "got regex, choice"),
    ({"structured_outputs": {}}, "structured_outputs",
     "structured_outputs: exactly one of json, regex, choice, grammar, structural_tag, json_object is required, "
     "got none"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "structured_outputs: only one of response_format and structured_outputs may constrain the output"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern",
     "structured_outputs.whitespace_pattern: not supported by vmesh"),
    ({"structured_outputs": {"regex": "a", "backend": "outlines"}}, "structured_outputs.backend",
     "structured_outputs.backend: 'outlines' is not one of auto, xgrammar, llguidance"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice",
     "structured_outputs.choice: must be a non-empty list of strings"),
    ({"response_format": {"type": "json_object"}, "tools": [WEATHER], "tool_choice": "required"}, "response_format",
     "response_format: cannot be combined with tool_choice 'required' or a named function, whose output is the "
     "tool calls"),
])
def test_body_refusals_name_the_field(body: dict, param: str, message: str) -> None:
    with pytest.raises(RequestError) as err:
        chat_spec(**body)
    status, error = oai.request_error_body(err.value)
    assert (status, error["error"]["param"], error["error"]["message"]) == (400, param, message)
