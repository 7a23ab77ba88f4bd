"""POST /v1/embeddings on the frontend's HTTP app over a fake scheduler group: what each input
submits (pooling from --pooler-config, a request's normalize over it, one token), the reply in
OpenAI's shape (float and little-endian float32 base64, in input order, usage), and the 400s and
404 in OpenAI's error shape, naming the field."""

from __future__ import annotations

import asyncio
import base64
import struct
from typing import Any

import httpx
import pytest

from tests.support.frontends import serving_frontend
from vmesh.services.common.types import OutputBatch, Pooling, PoolingType, StreamOutput
from vmesh.services.common.wire.common import finish_from_proto
from vmesh.services.frontend.http_server import build_app
from vmesh.services.frontend.settings import parse_pooler_config
from vmesh.v1 import common_pb2

VECTORS = [[0.5, -1.25, 3.0], [2.0, 0.0, -0.125]]  # float32-exact


class CharTokenizer:
    """One token per character (id = code point); BOS (1) first when special tokens are added."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1] * add_special_tokens + [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))


async def embed(body: dict[str, Any], vectors: list[list[float]] | None = None, model_dir: Any = None,
                **settings: Any) -> tuple[httpx.Response, list[Any]]:
    """POST `body`; each submitted request gets its vector (in submission order) with one token.
    Returns the reply and the submissions."""
    f, scheduler = await serving_frontend(CharTokenizer(), **settings)
    f.model_dir = model_dir
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(f, None)), base_url="http://f") as http:
        call = asyncio.create_task(http.post("/v1/embeddings", json=body))
        if vectors is not None:
            await scheduler.until_submitted(len(vectors))
            keys = [s.frontend_key for s in scheduler.submitted]
            f.dispatch(OutputBatch([StreamOutput(key, "x", [120], finish_from_proto(common_pb2.FINISH_REASON_LENGTH),
                                                 3, 1, 0, embedding=vector)
                                    for key, vector in reversed(list(zip(keys, vectors)))]))
        return await call, scheduler.submitted


def test_a_batch_is_one_request_per_input_and_comes_back_in_input_order() -> None:
    reply, submitted = asyncio.run(embed({"input": ["ab", "c"], "model": "m", "user": "u"}, VECTORS))
    assert reply.status_code == 200, reply.text
    data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(VECTORS)]
    assert reply.json() == {"object": "list", "model": "m", "usage": {"prompt_tokens": 5, "total_tokens": 5},
                            "data": data}
    assert [list(s.prompt_token_ids) for s in submitted] == [[1, 97, 98], [1, 99]]
    for s in submitted:
        assert s.sampling.max_tokens == 1 and s.sampling.temperature == 0
        assert s.sampling.pooling == common_pb2.Pooling(type=common_pb2.POOLING_TYPE_LAST, normalize=True)


def test_base64_is_each_vectors_little_endian_float32() -> None:
    reply, _ = asyncio.run(embed({"input": [[5, 6], [7]], "encoding_format": "base64"}, VECTORS))
    assert reply.status_code == 200, reply.text
    decoded = [list(struct.unpack(f"<{len(v)}f", base64.b64decode(d["embedding"])))
               for v, d in zip(VECTORS, reply.json()["data"])]
    assert decoded == VECTORS


def test_the_pooler_config_pools_and_a_requests_normalize_overrides_it() -> None:
    body = {"input": "hi", "normalize": True, "add_special_tokens": False, "truncate_prompt_tokens": 1}
    reply, submitted = asyncio.run(embed(body, VECTORS[:1], pooler_config=Pooling(PoolingType.MEAN, False)))
    assert reply.status_code == 200, reply.text
    assert list(submitted[0].prompt_token_ids) == [105]  # no BOS; the last token kept
    assert submitted[0].sampling.pooling == common_pb2.Pooling(type=common_pb2.POOLING_TYPE_MEAN, normalize=True)


def test_pooler_config_is_vllms_json() -> None:
    assert parse_pooler_config('{"pooling_type": "MEAN", "normalize": false}') == Pooling(PoolingType.MEAN, False)
    assert parse_pooler_config("{}") == Pooling(PoolingType.LAST, True)
    for text, message in [('{"pooling_type": "STEP"}', "pooling_type 'STEP' is not one of LAST, MEAN, CLS"),
                          ('{"softmax": true}', "unknown key(s) softmax"), ("[]", "must be a JSON object")]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            parse_pooler_config(text)


@pytest.mark.parametrize(("body", "status", "param", "message"), [
    ({"input": "hi", "model": "other"}, 404, "model", "model: the model 'other' does not exist"),
    ({"input": []}, 400, "input", "input: empty"),
    ({"input": ""}, 400, "input", "input: empty"),
    ({"input": [list(range(2, 1002))]}, 400, "input", "input: 1000 tokens; the context holds 1000"),
    ({"input": "hi", "encoding_format": "int8"}, 400, "encoding_format", "encoding_format: Input should be"),
    ({"input": "hi", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens", "truncate_prompt_tokens: must"),
    ({"input": ["abc", "def"]}, 400, "input", "input: 8 prompt tokens x n=1; at most 5 per request"),
])
def test_refusals_name_the_field_in_openais_error_shape(body: dict, status: int, param: str, message: str) -> None:
    reply, submitted = asyncio.run(embed(body, max_request_tokens=5 if len(body["input"]) == 2 else 1 << 17))
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["message"].startswith(message), error
    assert error["code"] == ("model_not_found" if status == 404 else None)
    assert submitted == []


def test_dimensions_other_than_the_hidden_size_are_refused(embedded_model_dir: Any) -> None:
    async def main() -> None:
        reply, submitted = await embed({"input": "hi", "dimensions": 3}, model_dir=embedded_model_dir)
        assert reply.status_code == 400 and submitted == [], "refused before computing: the hidden size is 576"
        assert reply.json()["error"] == {
            "message": "dimensions: 3 is not served: this model's embeddings have 576 dimensions (its hidden size), "
                       "which vmesh does not reduce", "type": "invalid_request_error", "param": "dimensions",
            "code": None}
        # Without a model directory to read, the vector's own length is the hidden size.
        reply, _ = await embed({"input": "hi", "dimensions": 3}, VECTORS[:1])
        assert reply.status_code == 200, reply.text
        reply, _ = await embed({"input": "hi", "dimensions": 2}, VECTORS[:1])
        assert (reply.status_code, reply.json()["error"]["param"]) == (400, "dimensions"), reply.text

    asyncio.run(main())
