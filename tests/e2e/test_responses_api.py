"""The Responses API (POST /v1/responses) against a running mesh of the embedded model, driven by the
real `openai` client with strict response validation: greedy output identical to chat completions
for the same messages, usage, `incomplete` at max_output_tokens, the streamed events and their
final response, and the stateless refusal of previous_response_id. Everything on 127.0.0.1."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.conftest import wait_idle

INSTRUCTIONS = "You are a helpful assistant. Answer in one short sentence."
QUESTION = "What is the capital of France?"
MESSAGES = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]


@pytest.fixture(scope="module")
def mesh(plain_mesh):
    return plain_mesh


@pytest.fixture(scope="module")
def client(mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.http_url, api_key="none", max_retries=0, timeout=120,
                         _strict_response_validation=True)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def test_a_response_is_the_greedy_chat_completion_of_the_same_messages(client, model, embedded_tokenizer):
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=40, temperature=0)
    response = client.responses.create(model=model, input=QUESTION, instructions=INSTRUCTIONS,
                                       max_output_tokens=40, temperature=0, metadata={"run": "e2e"})
    assert response.id.startswith("resp_") and response.object == "response" and response.model == model
    assert response.output_text == chat.choices[0].message.content and response.output_text
    prompt_tokens = len(embedded_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                               return_dict=False))
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (prompt_tokens, chat.usage.completion_tokens)
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    # The greedy answer ends well within its budget (a stop), so the response is complete.
    assert chat.choices[0].finish_reason == "stop" and response.status == "completed"
    assert response.incomplete_details is None
    assert response.instructions == INSTRUCTIONS and response.metadata == {"run": "e2e"}
    assert response.max_output_tokens == 40 and response.temperature == 0

    items = [{"role": "system", "content": INSTRUCTIONS},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    as_items = client.responses.create(model=model, input=items, max_output_tokens=40, temperature=0)
    assert as_items.output_text == response.output_text


def test_max_output_tokens_makes_the_response_incomplete(client, model):
    cut = client.responses.create(model=model, input="Count from 1 to 50 with commas.", max_output_tokens=4,
                                  temperature=0)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 4 and cut.output[0].status == "incomplete" and cut.output_text


def test_a_streamed_response_is_the_unstreamed_one(client, model, mesh):
    request = {"model": model, "input": QUESTION, "instructions": INSTRUCTIONS, "max_output_tokens": 40,
               "temperature": 0}
    plain = client.responses.create(**request)
    with client.responses.stream(**request) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == plain.output_text
    assert plain.status == final.status == "completed"
    assert final.output_text == plain.output_text and final.usage == plain.usage
    assert final.output[0].id == events[2].item.id  # the streamed item's id, in the final response

    raw = list(client.responses.create(**request, stream=True))
    last = raw[-1].response
    assert [e.type for e in raw] == kinds
    assert last.output_text == plain.output_text and last.usage == plain.usage and last.status == plain.status
    wait_idle(mesh)


def test_previous_response_id_is_refused_as_vmesh_keeps_no_responses(client, model):
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=model, input="Hi", previous_response_id="resp_123")
    assert refused.value.status_code == 400 and refused.value.body["param"] == "previous_response_id"
    assert "keeps no responses" in refused.value.body["message"]
    with pytest.raises(openai.BadRequestError) as built_in:
        client.responses.create(model=model, input="Hi", tools=[{"type": "web_search"}])
    assert built_in.value.body["param"] == "tools[0].type"
