"""A small Python client for a running mesh.

    async with VmeshClient("127.0.0.1:50051") as client:
        async for out in client.generate(chat=[{"role": "user", "content": "Hi"}], max_tokens=32):
            print(out.text, end="")
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc

from vmesh.services.common.grpc_server import CHANNEL_OPTIONS
from vmesh.services.common.output_accumulator import OutputAccumulator
from vmesh.services.common.types import OutputMode
from vmesh.services.common.wire.common import OUTPUT_MODES_PB
from vmesh.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc


def sampling_params(**fields: Any) -> common_pb2.SamplingParams:
    """SamplingParams from keyword arguments; None leaves a field at its server-side default."""
    pb = common_pb2.SamplingParams()
    for name, value in fields.items():
        if value is None:
            continue
        if name == "output_mode":  # by its name: "delta", "cumulative" or "final_only"
            value = OUTPUT_MODES_PB[OutputMode(value)]
        if isinstance(value, (list, tuple)):
            getattr(pb, name).extend(value)
        else:
            setattr(pb, name, value)
    return pb


def generate_request(text: str | None = None, chat: Sequence[dict[str, str]] | None = None,
                     token_ids: Sequence[int] | None = None, model: str = "", priority: int = 0,
                     **sampling: Any) -> frontend_pb2.GenerateRequest:
    request = frontend_pb2.GenerateRequest(model=model, sampling=sampling_params(**sampling), priority=priority)
    if text is not None:
        request.text = text
    elif chat is not None:
        request.chat.messages.extend(frontend_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in chat)
    elif token_ids is not None:
        request.token_ids.ids.extend(token_ids)
    return request


class VmeshClient:
    def __init__(self, address: str, api_key: str | None = None, tls_ca: str | None = None):
        """`api_key`: for a frontend started with --api-key; sent as `authorization: Bearer KEY`.
        `tls_ca`: a PEM file of the CA that signed the frontend's public certificate, for a
        frontend started with --public-tls-cert; without it the connection is plaintext."""
        self.address = address
        self.tls_ca = tls_ca
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        self._channel: grpc.aio.Channel | None = None
        self._stub: frontend_pb2_grpc.FrontendServiceStub | None = None

    async def __aenter__(self) -> VmeshClient:
        if self.tls_ca:
            credentials = grpc.ssl_channel_credentials(root_certificates=Path(self.tls_ca).read_bytes())
            self._channel = grpc.aio.secure_channel(self.address, credentials, options=CHANNEL_OPTIONS)
        else:
            self._channel = grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        self._stub = frontend_pb2_grpc.FrontendServiceStub(self._channel)
        return self

    @property
    def stub(self) -> frontend_pb2_grpc.FrontendServiceStub:
        if self._stub is None:
            raise RuntimeError("VmeshClient is used inside `async with`")
        return self._stub

    async def __aexit__(self, *exc: object) -> None:
        if self._channel is not None:
            await self._channel.close()

    async def generate(self, text: str | None = None, chat: Sequence[dict[str, str]] | None = None,
                       token_ids: Sequence[int] | None = None, *, timeout: float | None = None,
                       **sampling: Any) -> AsyncIterator[frontend_pb2.GenerateResponse]:
        call = self.stub.Generate(generate_request(text, chat, token_ids, **sampling), timeout=timeout,
                                  metadata=self.metadata)
        try:
            async for response in call:
                yield response
        finally:
            call.cancel()  # a no-op when complete; aborts the request when the caller stops early

    async def complete(self, **kwargs: Any) -> tuple[str, list[int], frontend_pb2.GenerateResponse]:
        """The whole text and token ids of one request, and its last response (finish reason, usage)."""
        output = OutputAccumulator[frontend_pb2.GeneratedTokenLogprobs].for_mode(
            OutputMode(kwargs.get("output_mode") or OutputMode.DELTA.value))
        last = None
        async for out in self.generate(**kwargs):
            output.extend(out.text, out.token_ids)
            last = out
        if last is None:
            raise RuntimeError("the stream ended without a response")
        return output.text, output.token_ids, last

    async def tokenize(self, text: str) -> list[int]:
        reply = await self.stub.Tokenize(frontend_pb2.TokenizeRequest(text=text), metadata=self.metadata)
        return list(reply.token_ids)

    async def model_info(self) -> frontend_pb2.GetModelInfoResponse:
        return await self.stub.GetModelInfo(frontend_pb2.GetModelInfoRequest(), metadata=self.metadata)
