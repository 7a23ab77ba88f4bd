"""POST /v1/embeddings in OpenAI's shape (`input`: a text, texts, token ids or lists of them;
`encoding_format` float or base64; `dimensions` only as the model's hidden size; `user` accepted)
with vLLM's extras `normalize`, `add_special_tokens` and `truncate_prompt_tokens`.

Each input is one request of the mesh with SamplingParams.pooling set and max_tokens 1: the
worker pools the prompt's final hidden states (services/worker/pooling.py) and the vector comes
back with the one token sampled, which is left out of the reply. The pooling is the server's
--pooler-config (FrontendSettings.pooling); a request's `normalize` overrides its normalize."""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import struct
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import Field

from vmesh.services.common.generation import GenerationRequest
from vmesh.services.common.model_loading import ModelLoadError, load_model_spec
from vmesh.services.common.types import Pooling, SamplingParams
from vmesh.services.frontend import openai_protocol as oai
from vmesh.services.frontend.core import FrontendCore
from vmesh.services.frontend.errors import Code, RequestError, refused_as_request_errors
from vmesh.services.frontend.fanout import ClientGone, Fanout, until_disconnect
from vmesh.services.frontend.http_middleware import request_error_response
from vmesh.services.frontend.inputs import check_request_budget, check_request_tokens, prompt_bytes

# OpenAI's own cap on one request's inputs; the request's token budget bounds their cost.
MAX_EMBEDDING_INPUTS = 2048
# The gRPC API's names for what a refusal names, as this body spells them.
ALIASES = {"prompt": "input", "token_ids": "input", "input": "input"}


class EmbeddingRequest(oai.RequestBody):
    model: str | None = Field(None, description="the served model's id; omitted: the served model")
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: each vector's little-endian float32 bytes, as the openai client decodes them")
    dimensions: int | None = Field(None, description="only the model's hidden size is served (refused otherwise)")
    user: str | None = Field(None, description="accepted and ignored")
    normalize: bool | None = Field(None, description="vLLM's: scale to unit L2 norm; omitted: --pooler-config's")
    add_special_tokens: bool = Field(True, description="vLLM's: texts are tokenized with the tokenizer's special "
                                                       "tokens (e.g. BOS)")
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, description="vLLM's: keep each input's last N tokens; -1: as many as the context admits")


def _inputs(body: EmbeddingRequest) -> list[str | list[int]]:
    value = body.input
    one = isinstance(value, str) or (value and isinstance(value[0], int))
    inputs: list[Any] = [value] if one else list(value)
    if not inputs:
        raise oai.invalid("input", "empty")
    if len(inputs) > MAX_EMBEDDING_INPUTS:
        raise oai.invalid("input", f"{len(inputs)} inputs; at most {MAX_EMBEDDING_INPUTS} per request")
    return [oai.utf8_text("input", i) if isinstance(i, str) else i for i in inputs]


@functools.cache
def _hidden_size(model_dir: Path) -> int | None:
    try:
        return load_model_spec(model_dir).hidden_size
    except ModelLoadError:  # e.g. a GGUF file: the vectors' length is checked instead
        return None


def _check_dimensions(dimensions: int | None, size: int | None) -> None:
    if dimensions is not None and size is not None and dimensions != size:
        raise oai.invalid("dimensions", f"{dimensions} is not served: this model's embeddings have {size} "
                                        "dimensions (its hidden size), which vmesh does not reduce")


def _tokenize(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens)) if text else []


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector


class EmbeddingRoutes:
    def __init__(self, frontend: FrontendCore):
        self.frontend = frontend

    async def _prompts(self, body: EmbeddingRequest, inputs: list[str | list[int]]) -> list[list[int]]:
        """Each input's token ids, texts tokenized one at a time (off the loop), within the request's budgets."""
        settings = self.frontend.settings
        with refused_as_request_errors():
            check_request_budget(inputs, 1, settings.max_request_bytes, settings.max_request_tokens)
        tokenizer = self.frontend.tokenizer
        keep = body.truncate_prompt_tokens
        if keep == -1:
            keep = self.frontend.loaded_limits().max_model_len - 1  # the room for the prompt and its one token
        prompts: list[list[int]] = []
        for item in inputs:
            if isinstance(item, str):
                if prompt_bytes(item) > settings.max_prompt_bytes:
                    raise oai.invalid("input", f"{prompt_bytes(item)} bytes of text; at most "
                                               f"{settings.max_prompt_bytes} are accepted")
                ids = await asyncio.get_running_loop().run_in_executor(
                    self.frontend.tokenizer_pool, _tokenize, tokenizer, item, body.add_special_tokens)
            else:
                ids = list(item)
            prompts.append(ids[-keep:] if keep else ids)
            with refused_as_request_errors():
                check_request_tokens(sum(map(len, prompts)), 1, settings.max_request_tokens)
        return prompts

    async def embeddings(self, body: EmbeddingRequest, http_request: Request) -> Response:
        try:
            self.frontend.ready()
            model = self.frontend.loaded_limits().name
            oai.check_model(body.model, model)
            if body.truncate_prompt_tokens == 0:
                raise oai.invalid("truncate_prompt_tokens", "must be -1 or at least 1")
            model_dir = self.frontend.model_dir
            _check_dimensions(body.dimensions, _hidden_size(model_dir) if model_dir is not None else None)
            pooling = self.frontend.settings.pooling
            if body.normalize is not None:
                pooling = replace(pooling, normalize=body.normalize)
            return await until_disconnect(http_request, self._run(body, model, pooling, http_request))
        except RequestError as exc:
            return request_error_response(exc, ALIASES)
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; nginx's code for "client closed"

    async def _run(self, body: EmbeddingRequest, model: str, pooling: Pooling, http_request: Request) -> Response:
        prompts = await self._prompts(body, _inputs(body))
        # One token is sampled (greedy: no generator to seed) and left out; the vector comes with it.
        sampling = SamplingParams(temperature=0, max_tokens=1, pooling=pooling)
        fanout = Fanout([self.frontend.generate(GenerationRequest(p, sampling, model=model),
                                                trace_headers=http_request.headers, operation="embeddings")
                         for p in prompts])
        vectors: dict[int, list[float]] = {}
        try:
            async for index, out in fanout.events():
                vectors[index] = vectors.get(index) or out.embedding
        finally:
            await fanout.close()
        if len(vectors) != len(prompts) or not all(vectors.values()):
            raise RequestError(Code.INTERNAL, "an input's embedding did not come back")
        _check_dimensions(body.dimensions, len(vectors[0]))
        data = [{"object": "embedding", "index": i, "embedding": _encoded(vectors[i], body.encoding_format)}
                for i in range(len(prompts))]
        tokens = sum(map(len, prompts))
        reply = {"object": "list", "data": data, "model": model,
                 "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
        # A batch of vectors is long to render: a worker thread keeps the loop serving other requests meanwhile.
        encoded = await asyncio.to_thread(lambda: json.dumps(reply, allow_nan=False, separators=(",", ":")).encode())
        return Response(encoded, media_type="application/json")


def add_routes(app: FastAPI, frontend: FrontendCore) -> None:
    routes = EmbeddingRoutes(frontend)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        return await routes.embeddings(body, request)
