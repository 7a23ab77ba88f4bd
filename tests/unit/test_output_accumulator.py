"""One request's outputs added up, whatever their output mode: the rule every consumer of a
stream of outputs shares (outbox, HTTP choices, the engine's generate, the client's complete)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from vmesh.services.client import VmeshClient
from vmesh.services.common.output_accumulator import OutputAccumulator
from vmesh.services.common.types import OutputMode
from vmesh.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc

# The texts one request's outputs carry in each mode (the detokenizer's contract).
TEXTS = {OutputMode.DELTA: ["He", "llo", "", "!"], OutputMode.CUMULATIVE: ["He", "Hello", "Hello", "Hello!"],
         OutputMode.FINAL_ONLY: ["", "", "", "Hello!"]}


@pytest.mark.parametrize("mode", list(OutputMode))
def test_every_mode_adds_up_to_the_whole_text_and_every_token(mode: OutputMode) -> None:
    output = OutputAccumulator[float].for_mode(mode)
    for i, text in enumerate(TEXTS[mode]):
        output.extend(text, [i], [-0.5 * i])
    assert (output.text, output.token_ids, output.logprobs) == ("Hello!", [0, 1, 2, 3], [0.0, -0.5, -1.0, -1.5])


def test_an_output_without_text_keeps_the_whole_text_outside_delta_mode() -> None:
    """An error's output carries no text: in cumulative mode the text so far stays whole."""
    output = OutputAccumulator[float].for_mode(OutputMode.CUMULATIVE)
    output.extend("Hel", [1, 2])
    output.extend("", [])
    assert output.text == "Hel" and output.token_ids == [1, 2]


class Frontend(frontend_pb2_grpc.FrontendServiceServicer):
    """Answers Generate with the texts of the output mode the request asked for."""

    async def Generate(self, request: frontend_pb2.GenerateRequest, context: Any) -> Any:
        mode = {common_pb2.OUTPUT_MODE_CUMULATIVE: OutputMode.CUMULATIVE,
                common_pb2.OUTPUT_MODE_FINAL_ONLY: OutputMode.FINAL_ONLY}.get(request.sampling.output_mode,
                                                                               OutputMode.DELTA)
        texts = TEXTS[mode]
        for i, text in enumerate(texts):
            last = i == len(texts) - 1
            yield frontend_pb2.GenerateResponse(text=text, token_ids=[i],
                                                finish_reason=common_pb2.FINISH_REASON_STOP if last else 0)


@pytest.mark.parametrize("mode", [None, "delta", "cumulative", "final_only"])
def test_the_client_completes_a_request_in_the_mode_it_asked_for(mode: str | None) -> None:
    async def main() -> tuple[str, list[int], frontend_pb2.GenerateResponse]:
        server = grpc.aio.server()
        frontend_pb2_grpc.add_FrontendServiceServicer_to_server(Frontend(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with VmeshClient(f"127.0.0.1:{port}") as client:
                return await client.complete(text="Hi", output_mode=mode)
        finally:
            await server.stop(None)

    text, ids, last = asyncio.run(main())
    assert (text, ids, last.finish_reason) == ("Hello!", [0, 1, 2, 3], common_pb2.FINISH_REASON_STOP)
