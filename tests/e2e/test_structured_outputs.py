"""Structured outputs against a running mesh of the embedded model, driven by the real `openai`
client: `chat.completions.parse` with a pydantic model; every schema of the test corpus, greedy
or sampled (each schema one way), validates with jsonschema; json_object, regex, choice and
grammars (EBNF and Lark); forced tool calls whose arguments validate, streamed as they are
returned whole; the Responses API's text.format; refusals naming the keyword or the budget;
greedy constrained output the same at pipeline depth 1 and 2, with a stateless worker, and
across a kill -9 of the worker and of a detokenizer replica mid-stream. Everything on
127.0.0.1, ports chosen at run time."""

from __future__ import annotations

import asyncio
import json
import re
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.e2e.test_chaos import wait_restarted
from tests.support.eventually import eventually
from tests.support.meshes import stops_cleanly
from tests.support.schema_corpus import assert_valid, load_corpus
from vmesh.services.bench.mesh import RunningMesh, start_mesh
from vmesh.services.frontend.structured_requests import BACKEND_HEADER

TIMEOUT_S = 300.0
# Room for every corpus output to close its structure: a request cut at max_tokens mid-structure
# finishes with "length", which the tests report rather than validate.
MAX_TOKENS = 384
UNBOUNDED_MAX_TOKENS = 96
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                "population": {"type": "integer", "minimum": 0}},
               "required": ["city", "population"], "additionalProperties": False}
# Long enough that a kill lands mid-stream.
STORY_SCHEMA = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 30},
                                                 "story": {"type": "string", "minLength": 120, "maxLength": 160}},
                "required": ["title", "story"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"timezone": {"type": "string", "pattern": "^[A-Z][a-z]+/[A-Z][a-z]+$"}},
    "required": ["timezone"], "additionalProperties": False}}}


def ask(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def schema_prompt(name: str, schema: Any) -> list[dict[str, str]]:
    return [{"role": "system", "content": "Reply with JSON only, matching this JSON schema: " + json.dumps(schema)},
            {"role": "user", "content": f"Give one realistic example of a {name.replace('_', ' ')}."}]


def json_schema_format(name: str, schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def mesh() -> Iterator[RunningMesh]:
    # Recovery timeouts far beyond a restart: on a slow machine a reload must not become a failure.
    mesh = start_mesh("--detokenizers", "2", "--worker-recovery-timeout", "120", "--failover-timeout", "120")
    yield mesh
    mesh.stop()


@pytest.fixture(scope="module")
def client(mesh: RunningMesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.http_url, api_key="none", max_retries=0, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


class City(BaseModel):
    city: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population: int = Field(ge=0, le=100_000_000)  # bounded: a small model may repeat a digit forever


def test_parse_with_a_pydantic_model_returns_the_parsed_object(client, model):
    completion = client.chat.completions.parse(model=model, messages=ask("Describe Paris as JSON."),
                                               response_format=City, max_tokens=MAX_TOKENS, temperature=0)
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop", message.content
    assert isinstance(message.parsed, City) and message.parsed == City.model_validate_json(message.content)


def test_the_backend_is_named_in_a_response_header(client, model):
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=ask("A city?"), max_tokens=MAX_TOKENS, temperature=0,
        response_format=json_schema_format("city", CITY_SCHEMA))
    assert raw.headers[BACKEND_HEADER] == "xgrammar"
    assert_valid(CITY_SCHEMA, raw.parse().choices[0].message.content)
    lark = client.completions.with_raw_response.create(model=model, prompt="Say hi:", max_tokens=16, extra_body={
        "structured_outputs": {"grammar": 'start: ("Hi" | "Hello") " " ("Ann" | "Bob")'}})
    assert lark.headers[BACKEND_HEADER] == "llguidance"
    assert re.fullmatch(r"(Hi|Hello) (Ann|Bob)", lark.parse().choices[0].text)
    plain = client.completions.with_raw_response.create(model=model, prompt="Hi", max_tokens=2)
    assert BACKEND_HEADER not in plain.headers


def unbounded_output(schema: Any, tags: frozenset[str]) -> bool:
    """Whether a schema's valid instances have no length bound: recursion (a tree may nest without
    end) or a time format (its fraction of a second may have any number of digits)."""
    return "recursive-ref" in tags or any(f'"format": "{name}"' in json.dumps(schema) for name in ("time", "date-time"))


async def corpus_outputs(mesh: RunningMesh, model: str) -> list[tuple[str, str, Any, str | None, str]]:
    """(case, greedy|sampled, schema, finish reason, text) for every corpus schema, all at once.
    Each schema runs one way, chosen by its name (so a schema added to the corpus moves no
    other): both ways for all doubled the test's minutes on 2 cores; the engine's parity tests
    take the sampled and greedy paths through the grammar matcher on their own."""
    client = openai.AsyncOpenAI(base_url=mesh.http_url, api_key="none", max_retries=0, timeout=TIMEOUT_S)
    modes = (("greedy", {"temperature": 0}), ("sampled", {"temperature": 0.8, "seed": 7}))
    runs = [(case, *modes[zlib.crc32(case.name.encode()) % 2]) for case in load_corpus()]

    async def one(case: Any, settings: dict[str, Any]) -> tuple[str | None, str]:
        # An unbounded schema's output may run to max_tokens whatever the budget: a short one will do.
        budget = UNBOUNDED_MAX_TOKENS if unbounded_output(case.schema, case.tags) else MAX_TOKENS
        done = await client.chat.completions.create(model=model, messages=schema_prompt(case.name, case.schema),
                                                    max_tokens=budget, **settings,
                                                    response_format=json_schema_format("answer", case.schema))
        return done.choices[0].finish_reason, done.choices[0].message.content or ""

    try:
        results = await asyncio.gather(*(one(case, settings) for case, _, settings in runs))
    finally:
        await client.close()
    return [(case.name, mode, case.schema, finish, text) for (case, mode, _), (finish, text) in zip(runs, results)]


def test_every_corpus_schema_validates_greedy_or_sampled(mesh, model):
    outputs = asyncio.run(corpus_outputs(mesh, model))
    assert len(outputs) >= 60 and {mode for _, mode, *_ in outputs} == {"greedy", "sampled"}
    unbounded = {case.name for case in load_corpus() if unbounded_output(case.schema, case.tags)}
    failures = []
    for name, mode, schema, finish, text in outputs:
        if finish == "length" and name in unbounded:
            continue  # the grammar admits output longer than max_tokens, and a small model may write it
        if finish != "stop":
            failures.append(f"{name} ({mode}): finished with {finish!r} after {text!r}")
            continue
        try:
            assert_valid(schema, text)
        except AssertionError as exc:
            failures.append(f"{name} ({mode}): {exc}")
    assert not failures, f"{len(failures)} of {len(outputs)} outputs fail:\n" + "\n".join(failures)
    assert sum(finish == "stop" for *_, finish, _ in outputs) >= 0.8 * len(outputs)


def test_json_object_regex_choice_and_ebnf(client, model):
    obj = client.chat.completions.create(model=model, messages=ask("Describe a cat as a JSON object."),
                                         max_tokens=MAX_TOKENS, temperature=0, response_format={"type": "json_object"})
    assert obj.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    pattern = r"[A-Z][a-z]{2,9}, [0-9]{4}"
    regex = client.completions.create(model=model, prompt="A city and a year:", max_tokens=32, temperature=0,
                                      extra_body={"structured_outputs": {"regex": pattern}})
    assert re.fullmatch(pattern, regex.choices[0].text), regex.choices[0].text
    choices = ["red", "green", "blue"]
    for temperature in (0, 1.0):
        pick = client.chat.completions.create(model=model, messages=ask("Pick a colour."), max_tokens=8,
                                              temperature=temperature, extra_body={"structured_outputs": {
                                                  "choice": choices}})
        assert pick.choices[0].message.content in choices
    ebnf = 'root ::= greeting " " name "!"\ngreeting ::= "Hello" | "Hi"\nname ::= "Ann" | "Bob" | "Eve"'
    greeted = client.chat.completions.create(model=model, messages=ask("Greet someone."), max_tokens=16,
                                             temperature=0.7, seed=3,
                                             extra_body={"structured_outputs": {"grammar": ebnf}})
    assert re.fullmatch(r"(Hello|Hi) (Ann|Bob|Eve)!", greeted.choices[0].message.content)


def test_unsupported_keywords_and_over_budget_schemas_are_400s_naming_them(client, model):
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                        "uniqueItems": True}}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=ask("Tags?"), max_tokens=8,
                                       response_format=json_schema_format("tags", schema))
    assert err.value.body["param"] == "response_format.json_schema.schema"
    assert err.value.body["message"] == ("response_format.json_schema.schema: properties.tags.uniqueItems: the "
                                         "JSON-schema keyword 'uniqueItems' is not supported by xgrammar")
    huge = {"type": "string", "enum": [f"value-{i:06}" for i in range(5000)]}
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt="x", max_tokens=8, extra_body={"structured_outputs": {
            "json": huge}})
    assert err.value.body["param"] == "structured_outputs.json"
    assert err.value.body["message"] == (f"structured_outputs.json: the json_schema is {len(json.dumps(huge))} bytes, "
                                         "over the 65536-byte limit")


def tool_calls_of(choice_message: Any) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in choice_message.tool_calls or ()]


def streamed_tool_calls(stream: Any) -> tuple[list[tuple[str, str]], str | None]:
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for call in choice.delta.tool_calls or ():
                if call.function and call.function.name:
                    names[call.index] = call.function.name
                arguments[call.index] = arguments.get(call.index, "") + ((call.function and call.function.arguments)
                                                                         or "")
    return [(names[i], arguments.get(i, "")) for i in sorted(names)], finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_forced_tool_calls_validate_and_stream_as_they_return_whole(client, model, tool_choice):
    tools = [WEATHER, TIME]
    request = {"model": model, "messages": ask("What is the weather in Oslo, and the time in Tokyo?"),
               "tools": tools, "tool_choice": tool_choice, "max_tokens": MAX_TOKENS, "temperature": 0,
               # One call: with parallel calls the list has no bound, and a small model may not end it.
               "parallel_tool_calls": False}
    whole = client.chat.completions.create(**request)
    calls = tool_calls_of(whole.choices[0].message)
    ends = "tool_calls" if tool_choice == "required" else "stop"  # a named function: "stop", as OpenAI's
    assert whole.choices[0].finish_reason == ends and calls
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for name, arguments in calls:
        assert tool_choice == "required" or name == "get_time"
        jsonschema.validate(json.loads(arguments), parameters[name])
    streamed, finish = streamed_tool_calls(client.chat.completions.create(**request, stream=True))
    assert (streamed, finish) == (calls, ends)


def test_responses_text_format_validates(client, model):
    response = client.responses.create(model=model, input="Name a large city and its population.",
                                       max_output_tokens=MAX_TOKENS, temperature=0, text={"format": {
                                           "type": "json_schema", "name": "city", "schema": CITY_SCHEMA,
                                           "strict": True}})
    assert response.status == "completed"
    assert_valid(CITY_SCHEMA, response.output_text)


# --- the same greedy constrained output in every mode, and across failures --------------------------

PARITY_REQUESTS: list[dict[str, Any]] = [
    {"messages": schema_prompt("city", CITY_SCHEMA), "response_format": json_schema_format("city", CITY_SCHEMA)},
    {"messages": schema_prompt("story", STORY_SCHEMA), "response_format": json_schema_format("story", STORY_SCHEMA)},
    {"messages": ask("Describe a cat as a JSON object."), "response_format": {"type": "json_object"}},
    {"messages": ask("A date?"), "extra_body": {"structured_outputs": {"regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"}}},
]


async def greedy_streams(mesh: RunningMesh, model: str, kill: Callable[[], object] | None = None,
                         kill_after_chunks: int = 12) -> list[str]:
    """Every PARITY_REQUESTS request, greedy, streamed at once; `kill` runs once the streams have
    sent `kill_after_chunks` content chunks between them (all still running)."""
    client = openai.AsyncOpenAI(base_url=mesh.http_url, api_key="none", max_retries=0, timeout=TIMEOUT_S)
    progress = [0] * len(PARITY_REQUESTS)

    async def one(i: int, request: dict[str, Any]) -> str:
        text = ""
        stream = await client.chat.completions.create(model=model, max_tokens=MAX_TOKENS, temperature=0,
                                                      stream=True, **request)
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.delta.content or ""
                progress[i] += 1
        return text

    try:
        tasks = [asyncio.create_task(one(i, r)) for i, r in enumerate(PARITY_REQUESTS)]
        if kill is not None:
            await eventually(lambda: sum(progress) >= kill_after_chunks or any(t.done() for t in tasks),
                             budget_s=TIMEOUT_S, interval_s=0.01)
            assert not any(t.done() for t in tasks), "a stream ended before the kill"
            kill()
        return list(await asyncio.gather(*tasks))
    finally:
        await client.close()


@pytest.fixture(scope="module")
def reference(mesh, model) -> list[str]:
    """The default mesh's (pipeline depth 2, stateful worker) greedy outputs, checked."""
    outputs = asyncio.run(greedy_streams(mesh, model))
    assert_valid(CITY_SCHEMA, outputs[0])
    assert_valid(STORY_SCHEMA, outputs[1])
    assert isinstance(json.loads(outputs[2]), dict)
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", outputs[3])
    return outputs


def test_greedy_constrained_output_is_the_same_in_every_mode(reference, model):
    # The reference runs at depth 2 with a stateful worker: this mesh changes both (the engine's
    # integration tests take each mode apart).
    with stops_cleanly(start_mesh("--pipeline-depth", "1", "--stateless-worker")) as other:
        assert asyncio.run(greedy_streams(other, model)) == reference


@pytest.mark.parametrize("victim", ["worker", "detokenizer-0"])
def test_greedy_constrained_output_survives_a_kill(mesh, model, reference, victim):
    restarts = mesh.restarts[victim]
    outputs = asyncio.run(greedy_streams(mesh, model, lambda: mesh.kill_service(victim)))
    assert outputs == reference, f"{victim} killed: the constrained outputs differ from the undisturbed run"
    wait_restarted(mesh, victim, restarts + 1)
