"""The tool-call formats besides Hermes (mistral, llama3_json, pythonic) without a mesh: each parser
on whole outputs, parallel calls and malformed ones, the same result at every split of its text,
the built-in prompt's calls read back by their own parser, `auto`'s choice, special tokens
decoded for a marker and kept out of content, and a Mistral-format answer through the HTTP API
and the real `openai` client (a real tokenizer and detokenizer, a fake scheduler)."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.fake_scheduler import FakeScheduler
from tests.support.frontends import chat_completion, openai_client, serving_frontend
from tests.unit.test_tool_calls import ARGUMENTS, HI, WEATHER, check_split_invariance, ids, split_feed
from vmesh.services.common.tokenizer import ChatTokenizer
from vmesh.services.common.types import FinishReason, ModelLimits, OutputBatch, SamplingParams, StreamOutput
from vmesh.services.common.wire.sampling import sampling_from_proto
from vmesh.services.detokenizer.incremental import IncrementalDetokenizer
from vmesh.services.frontend.settings import TOOL_CALL_PARSERS, FrontendSettings
from vmesh.services.frontend.tool_calls import ToolPlan, check_tools
from vmesh.services.frontend.tool_parsers import (
    FORMATS,
    ContentDelta,
    Llama3JsonToolCallParser,
    MistralToolCallParser,
    PythonicToolCallParser,
    ToolCallDelta,
    choose_tool_format,
    parse_text,
)
from vmesh.services.frontend.tool_parsers.special_texts import SpecialTextFilter

NAMES = ["get_weather", "get_time"]
TAG = "<|python_tag|>"


def mistral() -> MistralToolCallParser:
    return MistralToolCallParser(NAMES, new_id=ids())


def llama3() -> Llama3JsonToolCallParser:
    return Llama3JsonToolCallParser(NAMES, new_id=ids())


def pythonic() -> PythonicToolCallParser:
    return PythonicToolCallParser(NAMES, new_id=ids())


def calls_of(calls: list[dict]) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


OSLO = ("get_weather", {"city": "Oslo"})
ROME = ("get_weather", {"city": "Rome", "unit": "c"})
NOW = ("get_time", {})


# --- mistral -----------------------------------------------------------------------------------

def test_mistral_reads_both_forms_and_parallel_calls_keeping_text_around_them():
    array = ('Let me check. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
             '{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\", \\"unit\\": \\"c\\"}"}]')
    content, calls = check_split_invariance(mistral, array)
    assert (content, calls_of(calls)) == ("Let me check.", [OSLO, ROME])
    assert [c["id"] for c in calls] == ["call_0", "call_1"]
    v11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{} Done.'
    content, calls = check_split_invariance(mistral, v11)
    assert (content, calls_of(calls)) == ("Done.", [OSLO, NOW])
    single = '[TOOL_CALLS]{"name": "get_time", "arguments": {}}'
    assert calls_of(check_split_invariance(mistral, single)[1]) == [NOW]
    # ids Mistral's templates accept back in the history: nine letters and digits
    ids_made = [c["id"] for c in parse_text(MistralToolCallParser(NAMES), array)[1]]
    assert all(len(i) == 9 and i.isalnum() for i in ids_made) and ids_made[0] != ids_made[1]


@pytest.mark.parametrize(("text", "content"), [
    ("[TOOL_CALLS] no calls after all", " no calls after all"),
    ('[TOOL_CALLS][{"name": "unknown", "arguments": {}}] tail', '[{"name": "unknown", "arguments": {}}] tail'),
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": [1]}]', '[{"name": "get_weather", "arguments": [1]}]'),
    ('[TOOL_CALLS][{"name": "get_weather"}, 3]', '[{"name": "get_weather"}, 3]'),
    ('[TOOL_CALLS][{"name": "get_weather", "argu', '[{"name": "get_weather", "argu'),  # cut off by max_tokens
    ("[TOOL_CALLS]get weather[ARGS]{}", "get weather[ARGS]{}"),
    ("[TOOL_CALLS]get_time[ARGS][1]", "get_time[ARGS][1]"),
    ("[TOOL_CALLS]", ""),
    ("just [TOOL_CALLS", "just [TOOL_CALLS"),
])
def test_mistral_malformed_calls_stay_content_without_the_marker(text, content):
    assert check_split_invariance(mistral, text) == (content, [])


def test_mistral_streams_each_call_as_its_first_delta_then_its_arguments():
    deltas = split_feed(mistral(), 'Hi [TOOL_CALLS][{"name": "get_time", "arguments": {"tz": "UTC"}}]', [4, 9, 30])
    assert deltas == [ContentDelta("Hi"), ToolCallDelta(0, "", "call_0", "get_time"), ToolCallDelta(0, '{"tz": "UTC"}')]


# --- llama3_json -------------------------------------------------------------------------------

def test_llama3_json_reads_a_bare_answer_the_python_tag_and_separated_calls():
    bare = '  {"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}'
    assert calls_of(check_split_invariance(llama3, bare)[1]) == [OSLO, NOW]
    tagged = ('Checking. <|python_tag|>{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
              '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "c"}} then more')
    content, calls = check_split_invariance(llama3, tagged)
    assert (content, calls_of(calls)) == ("Checking.then more", [OSLO, ROME])


@pytest.mark.parametrize(("text", "content"), [
    ('Here: {"name": "get_time", "parameters": {}}', 'Here: {"name": "get_time", "parameters": {}}'),  # not alone
    ('{"name": "unknown", "parameters": {}}', '{"name": "unknown", "parameters": {}}'),
    ('{"name": "get_time", "parameters": {}', '{"name": "get_time", "parameters": {}'),  # cut off
    ('<|python_tag|>brave_search.call(query="x")', 'brave_search.call(query="x")'),  # Llama's built-in tools
    ('{"a": 1} and {', '{"a": 1} and {'),
])
def test_llama3_json_text_that_is_not_calls_stays_content_without_the_tag(text, content):
    assert check_split_invariance(llama3, text) == (content, [])


def test_llama3_json_keeps_the_separator_of_a_failed_second_call():
    content, calls = check_split_invariance(llama3, '{"name": "get_time", "parameters": {}}; {"name": "x"}')
    assert (content, calls_of(calls)) == ('; {"name": "x"}', [NOW])


# --- pythonic ----------------------------------------------------------------------------------

def test_pythonic_reads_python_literals_into_json_arguments():
    text = ('[get_weather(city="Oslo", days=3, exact=True, tz=None, hours=[1, -2.5], extra={"k": (1, null)}), '
            "get_time(tz='it\\'s UTC')]")
    content, calls = check_split_invariance(pythonic, text)
    assert content == ""
    assert calls_of(calls) == [("get_weather", {"city": "Oslo", "days": 3, "exact": True, "tz": None,
                                                "hours": [1, -2.5], "extra": {"k": [1, None]}}),
                               ("get_time", {"tz": "it's UTC"})]


def test_pythonic_opens_a_list_at_the_start_of_a_line_only():
    text = 'I will check.\n  [get_time()]\nDone, see [get_time()] here.'
    content, calls = check_split_invariance(pythonic, text)
    assert (content, calls_of(calls)) == ("I will check.Done, see [get_time()] here.", [NOW])


@pytest.mark.parametrize("text", [
    "[a link](http://example.com) isn't a call", "[1, 2, 3]", "[get_weather('Oslo')]", "[get_weather(**kw)]",
    "[unknown(x=1)]", "[get_time(x=1 + 2)]", "[get_time(x=float('nan'))]", "[get_time(tz='UT", "[get_time",
    "[get_time(), 3]", "[]",
])
def test_pythonic_lists_that_are_not_calls_stay_content(text):
    assert check_split_invariance(pythonic, text) == (text, [])


# --- every format: the same message at every split, nothing lost ------------------------------

PY_ARGUMENTS = st.dictionaries(st.sampled_from(["city", "n", "unit_2"]), ARGUMENTS, max_size=3)


def mistral_call(calls: list[tuple[str, dict]], v11: bool) -> str:
    if v11:
        return "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in calls)
    return FORMATS["mistral"].prompt.write_calls(calls)


FORMAT_CASES: dict[str, Any] = {
    "mistral": (mistral, mistral_call, ["[TOOL_CALLS]"],
                ["[TOOL_CALLS]{", '[TOOL_CALLS][{"name": "nope", "arguments": {}}]', "[TOOL_CALLS]x y",
                 "[TOOL_CALLS]"]),
    "llama3_json": (llama3, lambda calls, flip: (" " if flip else "") + TAG + FORMATS["llama3_json"].prompt.write_calls(
        calls), [TAG], [TAG + "{", TAG + '{"name": "nope"}', TAG + "print(1)", '{"name": 1}']),
    "pythonic": (pythonic, lambda calls, flip: "\n" + ("  " if flip else "") + FORMATS["pythonic"].prompt.write_calls(
        calls), [], ["\n[", "\n[nope()]", "\n[get_time(1)]", "\n[x]("]),
}


@pytest.mark.parametrize("name", sorted(FORMAT_CASES))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_every_format_assembles_to_one_message_however_split_and_loses_no_text(name, data):
    make, write, markers, bad = FORMAT_CASES[name]
    segments = data.draw(st.lists(st.one_of(
        st.text(alphabet="ab ;\n\"'{}()[]_TOLCAS|<>", max_size=10).map(lambda t: ("text", t)),
        st.tuples(st.lists(st.tuples(st.sampled_from(NAMES), PY_ARGUMENTS), min_size=1, max_size=2),
                  st.booleans()).map(lambda c: ("call", c)),
        st.sampled_from(bad).map(lambda b: ("bad", b))), max_size=5))
    text = "".join(write(*v) if kind == "call" else v for kind, v in segments)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=6))
    content, calls = check_split_invariance(make, text, cuts)
    if not calls:  # nothing was read as calls: every character is content but the markers'
        stripped = text
        for marker in markers:
            stripped = stripped.replace(marker, "")
        assert content == stripped
    if all(k == "call" for k, _ in segments):  # calls alone: each one is found, in order
        assert calls_of(calls) == [c for _, (group, _) in segments for c in group]
        assert content == ""


# --- special tokens decoded for the marker, kept out of content --------------------------------

class Passthrough:
    """A parser that reads everything as content: the filter's output as it is."""

    calls = 0

    def feed(self, text: str) -> list[Any]:
        return [ContentDelta(text)] if text else []

    def finish(self) -> list[Any]:
        return []


DROPPED = ["</s>", "<s>", "<s>x", "[INST]"]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from([*DROPPED, "<", "s", ">", "x", "/", "[", " "]), max_size=12),
       st.lists(st.integers(0, 60), max_size=4))
def test_special_texts_are_taken_out_the_same_way_however_split(pieces, cuts):
    """As one pass over the whole text would: at each place the longest special text that starts there."""
    text = "".join(pieces)
    content, _ = check_split_invariance(lambda: SpecialTextFilter(Passthrough(), DROPPED), text,
                                        [c for c in cuts if c <= len(text)])
    assert content == re.sub("|".join(map(re.escape, sorted(DROPPED, key=len, reverse=True))), "", text)


def test_a_special_marker_makes_decoding_keep_special_tokens_and_content_drop_the_others():
    class Vocabulary:
        chat_template = None

        def __init__(self, special: dict[str, bool]):
            self.added_tokens_decoder = {i: type("Token", (), {"content": t, "special": s})()
                                         for i, (t, s) in enumerate(special.items())}

    mistral_vocab = Vocabulary({"</s>": True, "[TOOL_CALLS]": True, "[ARGS]": True, "[INST]": True})
    served = choose_tool_format("auto", mistral_vocab)
    assert (served.format.name, served.hidden_markers) == ("mistral", ("[TOOL_CALLS]", "[ARGS]"))
    plan = ToolPlan(check_tools([WEATHER]), "auto")
    reader, sampling = served.reader(plan, SamplingParams())
    assert reader is not None and not sampling.skip_special_tokens and reader.dropped == ("</s>", "[INST]")
    content, calls = parse_text(reader.parser(), 'Hi[INST] [TOOL_CALLS][{"name": "get_weather"}]</s>')
    assert (content, calls_of(calls)) == ("Hi", [("get_weather", {})])
    # the client keeps special tokens itself: they stay; forced calls and plain chats are left alone
    assert served.reader(plan, SamplingParams(skip_special_tokens=False))[0].dropped == ()
    assert served.reader(ToolPlan(plan.tools, "required"), SamplingParams())[1].skip_special_tokens
    assert served.reader(None, SamplingParams()) == (None, SamplingParams())
    # Qwen's <tool_call> is an added token but not a special one: decoding is left as it is
    qwen = choose_tool_format("auto", Vocabulary({"<tool_call>": False, "<|im_end|>": True}))
    assert (qwen.format.name, qwen.hidden_markers) == ("hermes", ())
    assert qwen.reader(plan, SamplingParams())[1].skip_special_tokens


# --- the format served: --tool-call-parser and `auto` ------------------------------------------

QWEN_LIKE = "{% if tools %}<tools>{{ tools | tojson }}</tools> answer in <tool_call></tool_call>{% endif %}"
MISTRAL_LIKE = "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}{% endif %}{% if m %}[TOOL_CALLS]{% endif %}"
LLAMA_LIKE = ("{% if tools %}<|start_header_id|>user{{ tools | tojson }}{% endif %}"
              "{% if c %}<|python_tag|>{% endif %}")
GEMMA_LIKE = "{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content }}<end_of_turn>\n{% endfor %}"
SMOL_LIKE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


@pytest.mark.parametrize(("template", "vocabulary", "model_type", "name"), [
    (QWEN_LIKE, {}, "qwen2", "hermes"),
    (MISTRAL_LIKE, {}, "mistral", "mistral"),
    (LLAMA_LIKE, {}, "llama", "llama3_json"),
    (SMOL_LIKE, {"[TOOL_CALLS]": True}, "mistral", "mistral"),  # a template without tools: the vocabulary
    (SMOL_LIKE, {"<|python_tag|>": True}, "llama", "llama3_json"),
    (SMOL_LIKE, {"<tool_call>": False}, "qwen2", "hermes"),
    (GEMMA_LIKE, {}, "", "pythonic"),
    (SMOL_LIKE, {}, "gemma3_text", "pythonic"),
    (SMOL_LIKE, {}, "llama", "hermes"),  # SmolLM2: the built-in prompt's Hermes
    (None, {}, "", "hermes"),
])
def test_auto_reads_the_template_then_the_vocabulary_then_the_family(template, vocabulary, model_type, name):
    from vmesh.services.frontend.tool_parsers.registry import automatic

    assert automatic(template or "", vocabulary, model_type)[0].name == name


def test_the_flag_names_every_format_and_overrides_auto():
    assert ("auto", *sorted(FORMATS)) == TOOL_CALL_PARSERS
    assert FrontendSettings().tool_call_parser == "auto"
    forced = choose_tool_format("pythonic", ChatTokenizer(None, QWEN_LIKE, {}))  # type: ignore[arg-type]
    assert (forced.format.name, forced.reason) == ("pythonic", "--tool-call-parser")
    with pytest.raises(ValueError, match="hermes"):
        choose_tool_format("granite", None)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_the_built_in_prompt_asks_for_the_format_and_its_calls_read_back(name, embedded_model_dir):
    """A template without tools (SmolLM2's) gets the format's instructions and past calls in it;
    what the prompt writes as calls, the format's parser reads back as the same calls."""
    fmt = FORMATS[name]
    for calls in ([OSLO], [OSLO, ROME, NOW], [("get_weather", {"city": 'a "quoted"\n\\ é', "n": [1, None, True]})]):
        content, parsed = parse_text(fmt.parser(NAMES), fmt.prompt.write_calls(calls))
        assert (content, calls_of(parsed)) == (None, calls)
    lean = ChatTokenizer.load(embedded_model_dir)
    lean.tool_prompt = fmt.prompt
    history = [*HI, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "-3 C"}]
    text = lean.render_chat(history, tools=[WEATHER])
    assert fmt.prompt.how_to_call in text and json.dumps(WEATHER) in text
    assert fmt.prompt.write_calls([OSLO]) in text and "<tool_response>\n-3 C\n</tool_response>" in text


# --- through the HTTP API, with the real openai client ----------------------------------------

ANSWER = ('Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
          '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "c"}}]')


@pytest.mark.parametrize("stream", [False, True])
def test_a_mistral_format_answer_becomes_tool_calls_through_the_openai_client(stream, embedded_model_dir):
    """A vocabulary with Mistral's [TOOL_CALLS] special token (SmolLM2's, one token added): `auto`
    serves the mistral format, the built-in prompt asks for it, decoding keeps the marker, and
    neither it nor the EOS reaches the client's content."""
    tokenizer = ChatTokenizer.load(embedded_model_dir)
    tokenizer.backend_tokenizer.add_special_tokens(["[TOOL_CALLS]"])
    marker = tokenizer.backend_tokenizer.token_to_id("[TOOL_CALLS]")
    eos = tokenizer.backend_tokenizer.token_to_id("<|im_end|>")
    answer = [*tokenizer.encode(ANSWER, add_special_tokens=False), eos]
    assert marker in answer

    async def main() -> tuple[Any, Any]:
        vocabulary = tokenizer.backend_tokenizer.get_vocab_size()
        f, scheduler = await serving_frontend(tokenizer, FakeScheduler(ModelLimits("m", 4096, vocabulary)))
        client = openai_client(f)
        body = {"model": "m", "messages": HI, "tools": [WEATHER], "max_tokens": 200}
        task = asyncio.create_task(chat_completion(client, body, stream))
        submission = asyncio.create_task(scheduler.until_submitted(1))
        await asyncio.wait([task, submission], return_when=asyncio.FIRST_COMPLETED)
        if task.done():  # refused before it was submitted: say why
            submission.cancel()
            await task
        submitted = scheduler.submitted[0]
        # the detokenizer's own decoding, with the sampling the frontend asked for
        detokenizer = IncrementalDetokenizer(tokenizer.backend_tokenizer, sampling_from_proto(submitted.sampling),
                                             list(submitted.prompt_token_ids))
        key = next(iter(f.outboxes))
        for i, token in enumerate(answer):
            last = i == len(answer) - 1
            text = detokenizer.update([token], finished=last).text
            f.dispatch(OutputBatch([StreamOutput(key, text, [token], FinishReason.STOP if last else None,
                                                 len(submitted.prompt_token_ids), i + 1, 0)]))
        result = await task
        await client.close()
        return result, submitted

    completion, submitted = asyncio.run(main())
    assert sampling_from_proto(submitted.sampling).skip_special_tokens is False
    assert marker in submitted.prompt_token_ids  # the built-in prompt asks for [TOOL_CALLS]
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [OSLO, ROME]
    assert all(len(c.id) == 9 and c.id.isalnum() for c in choice.message.tool_calls)
