"""The frontend's wire modules: the public API decoded into the core's GenerationRequest and its
outputs encoded (wire/public.py), the submission to a scheduler (wire/submission.py), and the
HTTP API building the very request the gRPC API decodes."""
from __future__ import annotations

import asyncio
import math

import pytest

from tests.support.fake_scheduler import FakeScheduler
from tests.support.frontends import serving_frontend
from tests.support.grpc_fakes import FakeContext
from vmesh.services.common.generation import Chat, ChatMessage, GenerationOutput, Submission, ToolCall
from vmesh.services.common.types import (
    FinishReason,
    ModelLimits,
    OutputBatch,
    OutputMode,
    SamplingParams,
    StreamOutput,
    StructuredOutput,
    TokenLogprobs,
    TraceContext,
    Usage,
)
from vmesh.services.common.wire.public import as_carried, output_to_public, prompt_from_public, request_from_public
from vmesh.services.common.wire.sampling import sampling_from_proto
from vmesh.services.common.wire.submission import abort_to_proto, submission_to_proto
from vmesh.services.frontend import openai_protocol as oai
from vmesh.services.frontend.server import FrontendServicer
from vmesh.v1 import common_pb2, frontend_pb2


def test_each_input_decodes_to_its_prompt():
    assert prompt_from_public(frontend_pb2.GenerateRequest(text="")) == ""  # set, if empty: admission refuses it
    assert prompt_from_public(frontend_pb2.GenerateRequest()) is None
    assert list(prompt_from_public(frontend_pb2.GenerateRequest(token_ids=frontend_pb2.TokenIds(ids=[3, 4])))) == [3, 4]
    chat = frontend_pb2.ChatMessages(tools='[{"type": "function"}]', messages=[
        frontend_pb2.ChatMessage(role="assistant",
                                 tool_calls=[frontend_pb2.ToolCall(id="c", name="f", arguments="{}")]),
        frontend_pb2.ChatMessage(role="tool", content="1", tool_call_id="c")])
    assert prompt_from_public(frontend_pb2.TokenizeRequest(chat=chat)) == Chat(
        [ChatMessage("assistant", "", [ToolCall("c", "f", "{}")]), ChatMessage("tool", "1", [], "c")],
        '[{"type": "function"}]')


def test_a_generate_request_decodes_with_its_settings_and_an_unset_max_tokens_marked():
    pb = frontend_pb2.GenerateRequest(model="m", text="hi", priority=-2, sampling=common_pb2.SamplingParams(
        temperature=0.5, stop=["x"], structured=common_pb2.StructuredOutput(kind=common_pb2.STRUCTURED_KIND_REGEX,
                                                                            source="a+")))
    request = request_from_public(pb)
    assert (request.prompt, request.model, request.priority, request.max_tokens_from_context) == ("hi", "m", -2, True)
    assert request.sampling == sampling_from_proto(pb.sampling)
    assert request.sampling.structured == StructuredOutput("regex", "a+")
    pb.sampling.max_tokens = 7
    assert not request_from_public(pb).max_tokens_from_context and request_from_public(pb).sampling.max_tokens == 7


def test_an_output_encodes_every_field():
    rows = [TokenLogprobs(-0.5, 1, [1, 3], [-0.5, -2.0]), TokenLogprobs(-1.0, 2, [], [])]
    out = GenerationOutput("9", "ab", [1, 2], rows, FinishReason.LENGTH, Usage(4, 2, 1), "xgrammar")
    pb = output_to_public(out)
    assert (pb.request_id, pb.text, list(pb.token_ids), pb.finish_reason, pb.structured_output_backend) == (
        "9", "ab", [1, 2], common_pb2.FINISH_REASON_LENGTH, "xgrammar")
    assert (pb.usage.prompt_tokens, pb.usage.completion_tokens, pb.usage.cached_prompt_tokens) == (4, 2, 1)
    assert [(e.logprob, e.rank, [(t.token_id, t.logprob) for t in e.top]) for e in pb.logprobs] == [
        (-0.5, 1, [(1, -0.5), (3, -2.0)]), (-1.0, 2, [])]
    running = output_to_public(GenerationOutput("9", "a", [1], []))
    assert running.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED and not running.HasField("usage")


def test_a_submission_encodes_every_field():
    sampling = SamplingParams(max_tokens=5, seed=3, stop=["."])
    pb = submission_to_proto(Submission("f", 7, [1, 2], sampling, priority=1, trace_context=TraceContext("tp", "ts"),
                                        detokenizers=["d:1"], resumed_output_token_ids=[9], resumed_text_length=2))
    assert (pb.frontend_id, pb.frontend_key, list(pb.prompt_token_ids), pb.priority) == ("f", 7, [1, 2], 1)
    assert (pb.trace_context.traceparent, pb.trace_context.tracestate, list(pb.detokenizers)) == ("tp", "ts", ["d:1"])
    assert (list(pb.resumed_output_token_ids), pb.resumed_text_length) == ([9], 2)
    assert sampling_from_proto(pb.sampling) == sampling
    assert (abort_to_proto("f", 7).frontend_id, abort_to_proto("f", 7).frontend_key) == ("f", 7)


def test_values_are_carried_as_the_public_api_carries_them():
    assert as_carried("sampling.top_p", 0.7) == common_pb2.SamplingParams(top_p=0.7).top_p != 0.7
    assert math.isinf(as_carried("sampling.temperature", 1e300))
    assert as_carried("sampling.top_k", -1) == -1 and as_carried("token_ids.ids", [0, 2**32 - 1]) == [0, 2**32 - 1]
    for path, value in [("sampling.top_k", 2**31), ("sampling.max_tokens", -1), ("token_ids.ids", [1, -1]),
                        ("priority", -(2**31) - 1)]:
        with pytest.raises(ValueError, match="out of range"):
            as_carried(path, value)


def test_the_http_api_builds_the_request_the_grpc_api_decodes():
    body = oai.CompletionRequest(prompt="hi", max_tokens=9, temperature=0.7, top_k=3, stop="x", seed=5, priority=2,
                                 logprobs=1)
    [http] = oai.completion_requests(body, "m")
    grpc = request_from_public(frontend_pb2.GenerateRequest(text="hi", priority=2, sampling=common_pb2.SamplingParams(
        max_tokens=9, temperature=0.7, top_k=3, stop=["x"], seed=5, logprobs=1,
        output_mode=common_pb2.OUTPUT_MODE_DELTA)))
    assert http == grpc and http.sampling.output_mode is OutputMode.DELTA
    chat = oai.chat_request(oai.ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]), "m")
    assert chat.max_tokens_from_context and chat.prompt == Chat([ChatMessage("user", "hi")])


def test_the_grpc_shell_serves_a_decoded_request_and_sends_encoded_outputs():
    """GenerateRequest in, GenerateResponses out, through the core: max_tokens unset is the
    context's room; the last response has the finish reason and the usage; Tokenize decodes too."""
    class Tokenizer:
        def encode(self, text: str) -> list[int]:
            return [ord(c) for c in text]

    async def main() -> tuple[list[frontend_pb2.GenerateResponse], int, list[int]]:
        f, scheduler = await serving_frontend(Tokenizer(), FakeScheduler(ModelLimits("m", 100, 200)))
        servicer = FrontendServicer(f)
        stream = servicer.Generate(frontend_pb2.GenerateRequest(token_ids=frontend_pb2.TokenIds(ids=[1, 2, 3])),
                                   FakeContext())
        first = asyncio.ensure_future(stream.__anext__())
        await scheduler.until_submitted(1)
        key = scheduler.submitted[0].frontend_key
        f.dispatch(OutputBatch([StreamOutput(key, "hi", [7, 8], FinishReason.LENGTH, 3, 2, 1)]))
        responses = [await first, *[r async for r in stream]]
        tokenized = await servicer.Tokenize(frontend_pb2.TokenizeRequest(text="ab"), FakeContext())
        await f.schedulers.close()
        return responses, scheduler.submitted[0].sampling.max_tokens, list(tokenized.token_ids)

    responses, max_tokens, tokenized = asyncio.run(main())
    assert max_tokens == 97 and tokenized == [97, 98]
    [last] = responses
    assert (last.text, list(last.token_ids), last.finish_reason) == ("hi", [7, 8], common_pb2.FINISH_REASON_LENGTH)
    assert last.request_id and (last.usage.prompt_tokens, last.usage.completion_tokens) == (3, 2)
