"""Every service refuses bytes that are not its messages with INVALID_ARGUMENT."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from vmesh.services.common.grpc_server import ServiceShell, channel
from vmesh.services.common.server_settings import ServerSettings
from vmesh.v1 import frontend_pb2, frontend_pb2_grpc, worker_pb2, worker_pb2_grpc

NOT_A_MESSAGE = b"\xff\xff\xff\xff"
# field 1 (text, a string) holding bytes that are not UTF-8
INVALID_UTF8_TEXT = bytes([0x0A, 2, 0xC3, 0x28])


class EchoFrontend(frontend_pb2_grpc.FrontendServiceServicer):
    async def Generate(self, request, context):
        yield frontend_pb2.GenerateResponse(text=request.text)

    async def Tokenize(self, request, context):
        return frontend_pb2.TokenizeResponse(token_ids=[len(request.text)])


async def _serve_and_call(method: str, payload: bytes, streaming: bool) -> grpc.StatusCode:
    shell = ServiceShell("frontend", frontend_pb2.DESCRIPTOR.services_by_name["FrontendService"], ServerSettings())
    frontend_pb2_grpc.add_FrontendServiceServicer_to_server(EchoFrontend(), shell.server)
    await shell.server.start()
    try:
        async with channel(shell.address) as ch:
            path = f"/vmesh.v1.FrontendService/{method}"
            try:
                if streaming:
                    async for _ in ch.unary_stream(path)(payload, timeout=10):
                        pass
                else:
                    await ch.unary_unary(path)(payload, timeout=10)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK
    finally:
        await shell.server.stop(None)


@pytest.mark.parametrize("payload", [NOT_A_MESSAGE, INVALID_UTF8_TEXT], ids=["garbage", "invalid-utf8"])
@pytest.mark.parametrize(("method", "streaming"), [("Generate", True), ("Tokenize", False)])
def test_malformed_requests_are_invalid_argument(method, streaming, payload):
    assert asyncio.run(_serve_and_call(method, payload, streaming)) == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(("method", "streaming"), [("Generate", True), ("Tokenize", False)])
def test_well_formed_requests_pass(method, streaming):
    payload = frontend_pb2.GenerateRequest(text="hi").SerializeToString()
    assert asyncio.run(_serve_and_call(method, payload, streaming)) == grpc.StatusCode.OK


class EchoWorker(worker_pb2_grpc.WorkerServiceServicer):
    """A stream-stream handler, as the worker's Execute is: one response per request."""

    def __init__(self) -> None:
        self.closed = asyncio.Event()

    async def Execute(self, request_iterator, context):
        try:
            async for request in request_iterator:
                yield worker_pb2.ExecuteResponse(step=request.step)
        finally:
            self.closed.set()


async def _stream_call(payloads: list[bytes]) -> tuple[grpc.StatusCode, int, bool]:
    servicer = EchoWorker()
    shell = ServiceShell("worker", worker_pb2.DESCRIPTOR.services_by_name["WorkerService"], ServerSettings())
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, shell.server)
    await shell.server.start()
    answered = 0
    try:
        async with channel(shell.address) as ch:
            call = ch.stream_stream("/vmesh.v1.WorkerService/Execute")(iter(payloads), timeout=10)
            try:
                async for _ in call:
                    answered += 1
            except grpc.aio.AioRpcError as exc:
                return exc.code(), answered, await _closed(servicer)
            return grpc.StatusCode.OK, answered, await _closed(servicer)
    finally:
        await shell.server.stop(None)


async def _closed(servicer: EchoWorker) -> bool:
    try:
        await asyncio.wait_for(servicer.closed.wait(), 5)
    except asyncio.TimeoutError:
        return False
    return True


def test_a_malformed_message_mid_stream_ends_the_stream_with_invalid_argument():
    good = worker_pb2.ExecuteRequest(step=1).SerializeToString()
    code, answered, closed = asyncio.run(_stream_call([good, NOT_A_MESSAGE, good]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and answered == 1
    assert closed  # the handler's own clean-up ran


def test_a_well_formed_stream_passes():
    messages = [worker_pb2.ExecuteRequest(step=i).SerializeToString() for i in range(3)]
    assert asyncio.run(_stream_call(messages)) == (grpc.StatusCode.OK, 3, True)
