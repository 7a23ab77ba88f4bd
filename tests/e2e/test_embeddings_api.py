"""POST /v1/embeddings through a running mesh with the real `openai` client: a batch of texts and
one of token ids, float and base64, equal to transformers' float32 final hidden states pooled as
the server's default pooling (LAST, normalized) says; vLLM's `normalize` off; and a refusal in
OpenAI's error shape. (MEAN, chunked prefill, the prefix cache and a lost worker are
tests/integration/test_embeddings.py's, on the same worker code.)"""

from __future__ import annotations

import openai
import pytest

from tests.support.reference import assert_embedding_matches, hf_embedding

MODEL = "SmolLM2-135M-Instruct"
TEXTS = ["The capital of France is Paris.", "Owls hunt at night over the quiet valley."]


@pytest.fixture(scope="module")
def client(plain_mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=plain_mesh.http_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def prompts(embedded_tokenizer) -> list[list[int]]:
    return [embedded_tokenizer.encode(t) for t in TEXTS]


@pytest.mark.parametrize("encoding_format", ["float", openai.omit], ids=["float", "base64"])
def test_a_batch_of_texts_equals_transformers(client, prompts, embedded_reference_model, encoding_format):
    # Given no encoding_format, the openai client asks for base64 and decodes it as little-endian float32.
    out = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format=encoding_format)
    assert [d.index for d in out.data] == [0, 1]
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(map(len, prompts))
    for data, prompt in zip(out.data, prompts):
        assert_embedding_matches(data.embedding, hf_embedding(embedded_reference_model, prompt, "LAST", True))


def test_token_ids_without_normalizing(client, prompts, embedded_reference_model):
    out = client.embeddings.create(model=MODEL, input=prompts, extra_body={"normalize": False})
    for data, prompt in zip(out.data, prompts):
        assert_embedding_matches(data.embedding, hf_embedding(embedded_reference_model, prompt, "LAST", False))


def test_other_dimensions_are_refused(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=MODEL, input="hi", dimensions=64)
    assert refused.value.param == "dimensions"
    with pytest.raises(openai.NotFoundError) as unknown:
        client.embeddings.create(model="other", input="hi")
    assert unknown.value.code == "model_not_found"
