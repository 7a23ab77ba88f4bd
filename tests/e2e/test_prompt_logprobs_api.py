"""Prompt logprobs through a running mesh, against transformers' float32 log-softmax over the
prompt: OpenAI's `echo` with `logprobs` (and max_tokens 0) and vLLM's `prompt_logprobs` over HTTP
with the real `openai` client, and the gRPC API's fields; an echo is asked again with its prompt in
the prefix cache. (Chunked prefill, prefix-cache hits and preemption are
tests/integration/test_prompt_logprobs.py's, on the same worker code.) Then lm-evaluation-harness
as a real client: its `local-completions` model against the mesh equals its `hf` model on the
same float32 weights, per item, on two tasks defined in tests/data/lm_eval/."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
import pytest
import torch

from tests.support.reference import assert_prompt_logprobs_match, hf_prompt_logprobs
from vmesh.services.client import VmeshClient
from vmesh.services.common.types import TokenLogprobs

PROMPT = ("The quick brown fox jumps over the lazy dog, and then it runs back into the forest to sleep under "
          "an old oak tree, where a family of owls has lived for many years, watching the seasons change and "
          "the river in the quiet valley below rise and fall.")
TOLERANCE = 1e-4
MODEL = "SmolLM2-135M-Instruct"
CHECKOUT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mesh(plain_mesh):
    return plain_mesh


@pytest.fixture(scope="module")
def client(mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.http_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def prompt_ids(embedded_tokenizer) -> list[int]:
    return embedded_tokenizer.encode(PROMPT)


@pytest.fixture(scope="module")
def reference(embedded_reference_model, prompt_ids) -> torch.Tensor:
    return hf_prompt_logprobs(embedded_reference_model, prompt_ids)


def expected(reference: torch.Tensor, prompt_ids: list[int]) -> list[float]:
    return reference.gather(1, torch.tensor(prompt_ids[1:])[:, None]).squeeze(1).tolist()


def test_echo_with_logprobs_and_no_generation(client, prompt_ids, reference, embedded_tokenizer):
    # Twice: the second time the prompt's blocks are in the prefix cache, which an echo does not read.
    for _ in range(2):
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
        choice = out.choices[0]
        assert choice.text == PROMPT
        assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(prompt_ids)
        logprobs = choice.logprobs
        assert logprobs.tokens == [embedded_tokenizer.decode([t]) for t in prompt_ids]
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        assert logprobs.token_logprobs[1:] == pytest.approx(expected(reference, prompt_ids), abs=TOLERANCE)
        top = reference.topk(2, dim=-1)
        for i, entry in enumerate(logprobs.top_logprobs[1:]):
            assert entry == {embedded_tokenizer.decode([int(t)]): pytest.approx(float(v), abs=TOLERANCE)
                             for t, v in zip(top.indices[i], top.values[i])}
        assert logprobs.text_offset[0] == 0 and logprobs.text_offset[1] == len(logprobs.tokens[0])


def test_echo_of_token_ids_with_generated_tokens(client, prompt_ids, reference, embedded_tokenizer):
    out = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=3, echo=True, logprobs=0,
                                    temperature=0)
    choice = out.choices[0]
    prompt_text = embedded_tokenizer.decode(prompt_ids)
    assert choice.text.startswith(prompt_text) and len(choice.text) > len(prompt_text)
    assert out.usage.completion_tokens == 3
    assert len(choice.logprobs.token_logprobs) == len(prompt_ids) + 3
    assert choice.logprobs.token_logprobs[1:len(prompt_ids)] == pytest.approx(expected(reference, prompt_ids),
                                                                            abs=TOLERANCE)
    assert all(lp is not None for lp in choice.logprobs.token_logprobs[len(prompt_ids):])
    # A one-token prompt has nothing scored, yet its echo still names its token.
    single = client.completions.create(model=MODEL, prompt=prompt_ids[:1], max_tokens=0, echo=True, logprobs=1)
    assert single.choices[0].logprobs.tokens == [embedded_tokenizer.decode(prompt_ids[:1])]
    assert single.choices[0].logprobs.token_logprobs == [None]


def test_vllm_prompt_logprobs_on_completions_and_chat(client, prompt_ids, reference, embedded_tokenizer,
                                                      embedded_reference_model):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 1})
    rows = out.choices[0].model_extra["prompt_logprobs"]
    assert len(rows) == len(prompt_ids) and rows[0] is None
    for token_id, row, logprob in zip(prompt_ids[1:], rows[1:], expected(reference, prompt_ids)):
        mine = row[str(token_id)]
        assert mine["logprob"] == pytest.approx(logprob, abs=TOLERANCE)
        assert mine["decoded_token"] == embedded_tokenizer.decode([token_id])
        assert 1 <= len(row) <= 2  # the prompt token and the top 1 (the same token when it is the top)
    messages = [{"role": "user", "content": "Name a famous painter."}]
    chat_ids = embedded_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                      return_dict=False)
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})
    chat_rows = chat.model_extra["prompt_logprobs"]
    chat_reference = hf_prompt_logprobs(embedded_reference_model, chat_ids)
    assert len(chat_rows) == len(chat_ids) and chat_rows[0] is None
    assert [row[str(t)]["logprob"] for t, row in zip(chat_ids[1:], chat_rows[1:])] == pytest.approx(
        expected(chat_reference, chat_ids), abs=TOLERANCE)


def test_streamed_echo_and_out_of_range_prompt_logprobs_are_refused(mesh):
    with httpx.Client(base_url=mesh.http_url, timeout=30) as http:
        reply = http.post("/completions", json={"prompt": "hi", "echo": True, "stream": True})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "echo"
        reply = http.post("/completions", json={"prompt": "hi", "prompt_logprobs": 21})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt_logprobs"
        assert "in [0, 20]" in reply.json()["error"]["message"]


def test_grpc_prompt_logprobs(mesh, prompt_ids, reference):
    async def ask():
        async with VmeshClient(mesh.address) as grpc_client:
            return [r async for r in grpc_client.generate(token_ids=prompt_ids, max_tokens=2, temperature=0,
                                                          prompt_logprobs=2)]

    responses = asyncio.run(ask())
    with_prompt = [r for r in responses if r.prompt_logprobs]
    assert len(with_prompt) == 1 and with_prompt[0] is responses[0]  # with the first token, once
    first = with_prompt[0]
    assert list(first.prompt_token_ids) == prompt_ids
    assert_prompt_logprobs_match(
        [TokenLogprobs(r.logprob, r.rank, [t.token_id for t in r.top], [t.logprob for t in r.top])
         for r in first.prompt_logprobs], prompt_ids, reference, 2)


# --- lm-evaluation-harness as a client ----------------------------------------------------------

LM_EVAL_TASKS = ["vmesh_multiple_choice", "vmesh_generate_until"]  # tests/data/lm_eval/


def _evaluate(model: str, model_args: str) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    # Only the repository's tasks: indexing lm-eval's own thousands of task files takes seconds.
    tasks = TaskManager(include_path=str(CHECKOUT / "tests/data/lm_eval"), include_defaults=False)
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=LM_EVAL_TASKS, batch_size=8,
                                   task_manager=tasks, log_samples=True)


def test_lm_eval_local_completions_equals_hf(mesh, embedded_model_dir, monkeypatch):
    """lm-eval's usual way of evaluating a served model (`local-completions`: echo with logprobs
    for loglikelihoods, plain completions for generation) against `hf` on the same float32 weights."""
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.chdir(CHECKOUT)  # the tasks name their data files from the checkout's root
    served = _evaluate("local-completions", f"model={MODEL},base_url={mesh.http_url}/completions,"
                       f"tokenizer_backend=huggingface,tokenizer={embedded_model_dir},tokenized_requests=True,"
                       f"num_concurrent=4,max_retries=1")
    reference = _evaluate("hf", f"pretrained={embedded_model_dir},dtype=float32,device=cpu")
    for task in LM_EVAL_TASKS:
        assert {k: v for k, v in served["results"][task].items() if "stderr" not in k} == {
            k: v for k, v in reference["results"][task].items() if "stderr" not in k}
    served_items = {s["doc_id"]: s for s in served["samples"]["vmesh_multiple_choice"]}
    reference_items = {s["doc_id"]: s for s in reference["samples"]["vmesh_multiple_choice"]}
    assert sorted(served_items) == sorted(reference_items) == list(range(10))
    for doc_id, item in reference_items.items():
        ours = [loglikelihood for loglikelihood, _ in served_items[doc_id]["filtered_resps"]]
        theirs = [loglikelihood for loglikelihood, _ in item["filtered_resps"]]
        assert ours == pytest.approx(theirs, abs=1e-3), f"item {doc_id}"
        assert served_items[doc_id]["acc"] == item["acc"]
    served_texts = [s["filtered_resps"] for s in served["samples"]["vmesh_generate_until"]]
    assert served_texts == [s["filtered_resps"] for s in reference["samples"]["vmesh_generate_until"]]
