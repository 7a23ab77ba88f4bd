"""The public gRPC API's LoRA loads: refused, before anything is sent to a scheduler, unless the
mesh serves run-time loading (as the HTTP endpoints exist only then)."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from tests.support.frontends import make_frontend
from vmesh.services.frontend.server import FrontendServicer
from vmesh.v1 import common_pb2


class Aborted(Exception):
    pass


class RecordingContext:
    def __init__(self) -> None:
        self.status: tuple[grpc.StatusCode, str] | None = None

    def invocation_metadata(self) -> tuple:
        return ()

    async def abort(self, code: grpc.StatusCode, message: str) -> None:
        self.status = (code, message)
        raise Aborted


@pytest.mark.parametrize("rpc", ["LoadLoraAdapter", "UnloadLoraAdapter"])
def test_without_runtime_updating_a_load_is_permission_denied_naming_the_flag(rpc):
    async def main() -> tuple[grpc.StatusCode, str] | None:
        frontend = make_frontend()
        context = RecordingContext()
        with pytest.raises(Aborted):
            await getattr(FrontendServicer(frontend), rpc)(
                common_pb2.LoraAdapterRequest(lora_name="chef", lora_path="/adapters/chef"), context)
        await frontend.close()
        return context.status

    code, message = asyncio.run(main()) or (None, "")
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert "--allow-runtime-lora-updating" in message
