"""`vmesh bench serving --workload structured` builds the standard prompts with a JSON schema each
and sends, per arm, exactly the bodies the openai client sends for the same call (no server: the
client's requests are caught by a mock transport)."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tests.support.schema_corpus import assert_valid, corpus_by_name
from vmesh.services.bench.cli import main as bench_main
from vmesh.services.bench.common import WORKLOADS
from vmesh.services.bench.serving import timed_openai_stream
from vmesh.services.bench.structured import (
    SCHEMAS,
    arm_bodies,
    burst_bodies,
    chat_body,
    chat_messages,
    load_structured_workload,
    parse_arms,
    ratios,
    response_format,
    warmup_bodies,
)

MODEL = "smollm2"


@pytest.fixture(scope="module")
def work():
    return load_structured_workload(None, None)


def test_standard_prompts_with_instruction_and_schemas_in_turn(work):
    standard = json.loads(WORKLOADS["standard"].read_text())
    spec = json.loads(SCHEMAS.read_text())
    names = [s["name"] for s in spec["schemas"]]
    assert len(work["prompts"]) == standard["n_requests"] and work["max_tokens"] == standard["max_new_tokens"]
    for i, (prompt, text) in enumerate(zip(work["prompts"], standard["prompts"], strict=True)):
        user = text.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
        assert prompt.messages == (("system", "You are a helpful assistant."), ("user", f"{user} Answer in JSON."))
        assert prompt.schema_name == names[i % len(names)]
    assert load_structured_workload(5, 7)["max_tokens"] == 7 and len(load_structured_workload(5, 7)["prompts"]) == 5


def test_bench_schemas_are_the_corpus_entries():
    corpus = corpus_by_name()
    spec = json.loads(SCHEMAS.read_text())
    assert len(spec["schemas"]) >= 3
    for entry in spec["schemas"]:
        case = corpus[entry["name"]]
        assert entry["schema"] == case.schema and "format" not in case.tags  # a backend may refuse formats


def test_chat_messages_refuses_what_is_not_chatml():
    assert chat_messages("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n") == [("user", "Hi")]
    with pytest.raises(ValueError, match="ChatML"):
        chat_messages("Write a poem.")


def _sent_by_openai_client(**create_kwargs) -> dict:
    """The JSON body the openai client sends for chat.completions.create(**create_kwargs)."""
    sent = []

    def handle(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=b"data: [DONE]\n\n")

    client = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="none",
                           http_client=httpx.Client(transport=httpx.MockTransport(handle)))
    list(client.chat.completions.create(**create_kwargs))
    [body] = sent
    return body


def test_bodies_are_the_openai_clients(work):
    prompt = work["prompts"][1]
    messages = [{"role": r, "content": c} for r, c in prompt.messages]
    common = {"model": MODEL, "messages": messages, "max_tokens": 128, "temperature": 0.0, "stream": True,
              "stream_options": {"include_usage": True}}
    constrained = _sent_by_openai_client(**common, response_format={
        "type": "json_schema", "json_schema": {"name": prompt.schema_name, "schema": prompt.schema, "strict": True}})
    assert chat_body(prompt, 128, constrained=True, model=MODEL) == constrained
    assert constrained["response_format"] == response_format(prompt.schema_name, prompt.schema)
    assert chat_body(prompt, 128, constrained=False, model=MODEL) == _sent_by_openai_client(**common)
    matched = _sent_by_openai_client(**{**common, "max_tokens": 57}, extra_body={"ignore_eos": True})
    assert chat_body(prompt, 57, constrained=False, model=MODEL, ignore_eos=True) == matched


def test_arms_decode_the_same_tokens_per_prompt(work):
    constrained = arm_bodies(work, "constrained", None)
    names = [b["response_format"]["json_schema"]["name"] for b in constrained]
    assert names == [p.schema_name for p in work["prompts"]]
    assert all(b["max_tokens"] == 128 and "ignore_eos" not in b and "model" not in b for b in constrained)
    produced = [(i * 7) % 128 for i in range(len(work["prompts"]))]
    matched = arm_bodies(work, "unconstrained", None, produced)
    assert [b["max_tokens"] for b in matched] == [max(1, n) for n in produced]
    assert all(b["ignore_eos"] is True and "response_format" not in b for b in matched)
    assert [b["messages"] for b in matched] == [b["messages"] for b in constrained]
    plain = arm_bodies(work, "unconstrained", None)
    assert all(b["max_tokens"] == 128 and "ignore_eos" not in b for b in plain)
    with pytest.raises(ValueError):
        arm_bodies(work, "unconstrained", None, produced[:-1])


def test_warmup_compiles_each_schema_once(work):
    names = {b["response_format"]["json_schema"]["name"] for b in warmup_bodies(work, "constrained", None)}
    assert names == set(work["schemas"]) and len(warmup_bodies(work, "constrained", None)) == len(names)
    [plain] = warmup_bodies(work, "unconstrained", None)
    assert "response_format" not in plain and plain["max_tokens"] == 2


def test_each_arm_is_preceded_by_a_short_burst_of_its_own_requests(work):
    for arm in ("constrained", "unconstrained"):
        bodies = arm_bodies(work, arm, None)
        burst = burst_bodies(bodies, 32)
        assert len(burst) == 32 and all(b["max_tokens"] == 2 for b in burst)
        assert [{**b, "max_tokens": 0} for b in burst] == [{**b, "max_tokens": 0} for b in bodies[:32]]
    assert len(burst_bodies(bodies, 0)) == 1


def test_arms_option():
    assert parse_arms("unconstrained,constrained") == ["constrained", "unconstrained"]
    assert parse_arms("unconstrained") == ["unconstrained"]
    for bad in ("", "constrained,constrained", "grammar"):
        with pytest.raises(SystemExit):
            parse_arms(bad)


def test_ratios_need_both_arms():
    arms = {"constrained": {"output_token_throughput": 90.0, "request_throughput": 1.8},
            "unconstrained": {"output_token_throughput": 100.0, "request_throughput": 2.0}}
    assert ratios(arms) == pytest.approx({"output_token_throughput": 0.9, "request_throughput": 0.9})
    assert ratios({"constrained": arms["constrained"]}) == {}


def test_a_streamed_chat_answer_is_timed_and_kept(work):
    """The chat stream's deltas make the text; the usage's count is the token total."""
    pieces = ['{"headline": "Snow', ' closes schools", "location": "Oslo", "urgency": "low", ',
              '"summary": "Snow.", "sources": []}']
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
    chunks += [{"choices": [{"index": 0, "delta": {"content": p}, "finish_reason": None}]} for p in pieces]
    chunks += [{"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
               {"choices": [], "usage": {"prompt_tokens": 30, "completion_tokens": 21, "total_tokens": 51}}]
    stream = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    seen = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, json.loads(request.content)))
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=stream.encode())

    body = chat_body(work["prompts"][1], 128, constrained=True)

    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as http:
            return await timed_openai_stream(http, "http://127.0.0.1:9/v1/chat/completions", body,
                                             lambda choice: (choice.get("delta") or {}).get("content"))

    result = asyncio.run(run())
    assert seen == [("/v1/chat/completions", body)]
    assert result["tokens"] == 21 and result["finish_reason"] == "stop" and len(result["itl"]) == len(pieces) - 1
    assert_valid(work["prompts"][1].schema, result["text"])


@pytest.mark.parametrize("argv", [["offline", "--workload", "structured"],
                                  ["serving", "--workload", "structured", "--backend", "grpc"],
                                  ["serving", "--workload", "structured", "--address", "127.0.0.1:9"],
                                  ["serving", "--workload", "structured", "--arms", "both"]])
def test_cli_refuses_what_the_workload_cannot_do(argv, tmp_path):
    """Refused before any server is started or reached."""
    with pytest.raises(SystemExit) as refused:
        bench_main([*argv, "--out", str(tmp_path)])
    assert "structured" in str(refused.value) or "--arms" in str(refused.value)
