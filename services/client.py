"""A small Python client for a running mesh.

    async with VmeshClient("127.0.0.1:50051") as client:
        async for out in client.generate(chat=[{"role": "user", "content": "Hi"}], max_tokens=32):
            print(out.text, end="")

Given several frontends' addresses, a stream whose frontend goes away is resumed through the
next one (GenerateRequest.resume), and the caller's iteration goes on with exactly what it lacked.
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
    def __init__(self, address: str | Sequence[str], api_key: str | None = None, tls_ca: str | None = None,
                 max_resumes: int = 3):
        """`address`: a frontend's, or several (a list, or comma-separated): a stream that breaks
        with UNAVAILABLE is resumed through the next, up to `max_resumes` times per request (sent
        again whole if no response had come back).
        `api_key`: for a frontend started with --api-key; sent as `authorization: Bearer KEY`.
        `tls_ca`: a PEM file of the CA that signed the frontend's public certificate, for a
        frontend started with --public-tls-cert; without it the connection is plaintext."""
        self.addresses = address.split(",") if isinstance(address, str) else list(address)
        self.tls_ca = tls_ca
        self.max_resumes = max_resumes
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        self._channels: list[grpc.aio.Channel] = []
        self._stubs: list[frontend_pb2_grpc.FrontendServiceStub] = []
        self._current = 0  # the frontend new calls go to: the last that answered

    async def __aenter__(self) -> VmeshClient:
        credentials = (grpc.ssl_channel_credentials(root_certificates=Path(self.tls_ca).read_bytes())
                       if self.tls_ca else None)
        for address in self.addresses:
            ch = (grpc.aio.secure_channel(address, credentials, options=CHANNEL_OPTIONS) if credentials
                  else grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS))
            self._channels.append(ch)
            self._stubs.append(frontend_pb2_grpc.FrontendServiceStub(ch))
        return self

    @property
    def stub(self) -> frontend_pb2_grpc.FrontendServiceStub:
        if not self._stubs:
            raise RuntimeError("VmeshClient is used inside `async with`")
        return self._stubs[self._current]

    async def __aexit__(self, *exc: object) -> None:
        for ch in self._channels:
            await ch.close()

    async def generate(self, text: str | None = None, chat: Sequence[dict[str, str]] | None = None,
                       token_ids: Sequence[int] | None = None, *, timeout: float | None = None,
                       **sampling: Any) -> AsyncIterator[frontend_pb2.GenerateResponse]:
        request = generate_request(text, chat, token_ids, **sampling)
        received = OutputAccumulator[Any].for_mode(OutputMode(sampling.get("output_mode") or OutputMode.DELTA.value))
        token = ""
        for attempt in range(self.max_resumes + 1):
            frontend = self._current
            call = self._stubs[frontend].Generate(request, timeout=timeout, metadata=self.metadata)
            try:
                async for response in call:
                    token = token or response.resume_token
                    received.extend(response.text, response.token_ids)
                    yield response
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or attempt == self.max_resumes:
                    raise
                # The same request again, through the next frontend, from where this stream broke
                # (from the start when nothing came back: there is nothing to lose).
                if self._current == frontend:  # and not already moved on by another call that broke
                    self._current = (frontend + 1) % len(self._stubs)
                if token:
                    request.resume.CopyFrom(frontend_pb2.Resume(
                        token=token, num_output_tokens=len(received.token_ids), text_length=len(received.text)))
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
