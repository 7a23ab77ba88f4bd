"""The frontend's shared request path and its HTTP shell, without a network: start-up and drain
refusals, the prompt byte limit, API keys, a cancel during submission, and OpenAI translation."""
from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from tests.support.eventually import eventually
from tests.support.fake_scheduler import FakeScheduler
from tests.support.frontends import make_frontend, serving_frontend
from tests.support.grpc_fakes import Aborted, FakeContext
from vmesh.services.common.admission import InvalidRequest
from vmesh.services.common.generation import Chat, ChatMessage, GenerationRequest, Submission
from vmesh.services.common.types import FinishReason, ModelLimits, OutputBatch, SamplingParams, StreamOutput
from vmesh.services.common.wire.common import finish_from_proto
from vmesh.services.frontend import openai_protocol as oai
from vmesh.services.frontend.auth import check_api_key
from vmesh.services.frontend.errors import RequestError
from vmesh.services.frontend.failover import submit
from vmesh.services.frontend.http_server import build_app
from vmesh.services.frontend.server import FrontendServicer
from vmesh.v1 import common_pb2, frontend_pb2


class RefusingTokenizer:
    """Fails the test if called: what must be refused is refused before tokenizing."""

    def encode(self, text: str) -> list[int]:
        raise AssertionError("tokenized")

    apply_chat_template = encode


async def drain(stream) -> list:
    return [x async for x in stream]


def test_a_starting_frontend_answers_unavailable_not_a_crash():
    f = make_frontend()
    with pytest.raises(RequestError) as err:
        asyncio.run(drain(f.generate(GenerationRequest("hi"))))
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(Aborted) as aborted:
        asyncio.run(drain(FrontendServicer(f).Generate(frontend_pb2.GenerateRequest(text="hi"), FakeContext())))
    assert aborted.value.code == grpc.StatusCode.UNAVAILABLE

    async def via_http():
        transport = httpx.ASGITransport(app=build_app(f, None))
        async with httpx.AsyncClient(transport=transport, base_url="http://frontend") as http:
            return (await http.post("/v1/completions", json={"prompt": "hi"}), await http.get("/health"),
                    await http.get("/v1/models"))

    for response in asyncio.run(via_http()):
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "service_unavailable_error"


def test_a_draining_frontend_refuses_new_requests():
    f = make_frontend(RefusingTokenizer(), ModelLimits("m", 100, 10))
    f.draining = True
    with pytest.raises(RequestError) as err:
        asyncio.run(drain(f.generate(GenerationRequest("hi"))))
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and "draining" in err.value.message


def test_prompts_over_the_byte_limit_are_refused_before_tokenizing():
    f = make_frontend(RefusingTokenizer(), ModelLimits("m", 100, 10), max_prompt_bytes=8)
    for request in (GenerationRequest("x" * 9), GenerationRequest(Chat([ChatMessage("user", "é" * 5)]))):
        with pytest.raises(RequestError) as err:
            asyncio.run(drain(f.generate(request)))
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in err.value.message
    with pytest.raises(RequestError):
        asyncio.run(f.encode("x" * 9))


def test_api_key():
    check_api_key(None, None)
    check_api_key("k", "Bearer k")
    for header in (None, "", "k", "Bearer x", "Basic k"):
        with pytest.raises(RequestError) as err:
            check_api_key("k", header)
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_a_cancel_during_submission_aborts_once_the_submission_resolves():
    class SlowScheduler(FakeScheduler):
        def __init__(self):
            super().__init__(ModelLimits("m", 100, 10))
            self.release = asyncio.Event()

        async def SubmitRequest(self, request, **kwargs):
            await self.release.wait()  # the scheduler takes it, but only after the client left
            return await super().SubmitRequest(request, **kwargs)

    async def main():
        scheduler = SlowScheduler()
        f = make_frontend(scheduler=scheduler)
        await f.join_schedulers()
        submission = Submission("", 7, [], SamplingParams())
        task = asyncio.create_task(submit(f, submission))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert scheduler.aborted == []
        scheduler.release.set()
        while f.background:
            await asyncio.sleep(0)
        return scheduler.aborted, f.schedulers.groups["s:1"].in_flight

    assert asyncio.run(main()) == ([7], 0)


def test_openai_bodies_translate_into_generate_requests():
    chat = oai.ChatCompletionRequest(messages=[{"role": "developer", "content": "Be brief."},
                                               {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                            {"type": "text", "text": "b"}]}],
                                     max_completion_tokens=5, max_tokens=9, logprobs=True, top_logprobs=2, seed=-1,
                                     stop="x", top_k=3, user="u", parallel_tool_calls=False)
    request = oai.chat_request(chat, "m")
    assert isinstance(request.prompt, Chat)
    assert [(m.role, m.content) for m in request.prompt.messages] == [("system", "Be brief."), ("user", "a\nb")]
    s = request.sampling
    assert (s.max_tokens, s.logprobs, s.seed, list(s.stop), s.top_k) == (5, 2, (1 << 64) - 1, ["x"], 3)
    assert s.temperature == SamplingParams().temperature  # unset: the server's default, as over gRPC

    completions = oai.completion_requests(oai.CompletionRequest(prompt=[[1, 2], [3]], n=2, seed=5), "m")
    assert [list(r.prompt) for r in completions] == [[1, 2], [3]]
    assert completions[0].sampling.max_tokens == 16  # OpenAI's default for completions
    copies = oai.fan_out(completions, 2, [[1, 2], [3]])
    assert [c.sampling.seed for c in copies] == [5, 6, 5, 6]
    assert [list(c.prompt) for c in copies] == [[1, 2], [1, 2], [3], [3]]
    # A text or chat prompt's copies carry the ids it was tokenized to once, and keep the rest.
    chat_copies = oai.fan_out([request], 2, [[7, 8]])
    assert [isinstance(c.prompt, list) for c in chat_copies] == [True] * 2
    assert [list(c.prompt) for c in chat_copies] == [[7, 8]] * 2
    assert chat_copies[1].sampling.max_tokens == 5 and chat_copies[1].sampling.top_k == 3


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "a", "echo": True, "stream": True}, "echo"), ({"prompt": "a", "suffix": "z"}, "suffix"),
    ({"prompt": "a", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": "a", "best_of": 2}, "best_of"), ({"prompt": "a", "logit_bias": {"1": 1.0}}, "logit_bias"),
    ({"prompt": "a", "max_tokens": -1}, "max_tokens"), ({"prompt": [-1]}, "prompt"), ({"prompt": []}, "prompt"),
    ({"prompt": "a", "n": 0}, "n"), ({"prompt": ["a"] * 9, "n": 8}, "n"),
    ({"prompt": "a", "logprobs": 6}, "logprobs"), ({"prompt": "a\ud800"}, "prompt"),
])
def test_refused_completion_fields_are_named(body, param):
    with pytest.raises(RequestError) as err:
        oai.completion_requests(oai.CompletionRequest(**body), "m")
    status, error = oai.request_error_body(err.value, oai.param_aliases(oai.CompletionRequest(**body)))
    assert status == 400 and error["error"]["param"] == param


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "function"}]}, "tools[0].function"), ({"tool_choice": "auto"}, "tool_choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"top_logprobs": 1}, "top_logprobs"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "critic", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x\udc00"}]}, "messages[0].content"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
def test_refused_chat_fields_are_named(body, param):
    with pytest.raises(RequestError) as err:
        oai.chat_request(oai.ChatCompletionRequest(**{"messages": [{"role": "user", "content": "hi"}], **body}), "m")
    assert oai.request_error_body(err.value)[1]["error"]["param"] == param


def test_unknown_model_is_404_and_errors_map_to_http_statuses():
    with pytest.raises(RequestError) as err:
        oai.completion_requests(oai.CompletionRequest(prompt="a", model="other"), "m")
    status, body = oai.request_error_body(err.value)
    assert status == 404  # OpenAI's shape for an unknown model: an invalid request, code model_not_found
    assert (body["error"]["type"], body["error"]["code"], body["error"]["param"]) == (
        "invalid_request_error", "model_not_found", "model")
    resume = oai.request_error_body(RequestError(grpc.StatusCode.NOT_FOUND, "nothing to resume"))
    assert resume[0] == 404 and resume[1]["error"]["code"] is None  # not a model
    for code, status in [(grpc.StatusCode.INVALID_ARGUMENT, 400), (grpc.StatusCode.UNAUTHENTICATED, 401),
                         (grpc.StatusCode.RESOURCE_EXHAUSTED, 429), (grpc.StatusCode.UNAVAILABLE, 503)]:
        assert oai.request_error_body(RequestError(code, "x"))[0] == status
    top_p = RequestError.invalid(InvalidRequest("sampling.top_p", "must be in (0, 1], got 2"))
    error = oai.request_error_body(top_p)[1]["error"]
    assert (error["param"], error["message"]) == ("top_p", "top_p: must be in (0, 1], got 2")  # the body's name
    empty = RequestError.invalid(InvalidRequest("prompt", "empty"))
    assert oai.request_error_body(empty)[1]["error"]["param"] == "prompt"


def failover_scheduler() -> FakeScheduler:
    """Names a new detokenizer replica for each submission."""
    return FakeScheduler(ModelLimits("m", 100, 50), detokenizer=lambda n: f"d:{n}")


def routed(f) -> bool:
    """Every request the frontend holds has its replica: a replica lost from now on is theirs."""
    return bool(f.outboxes) and all(o.detokenizer for o in f.outboxes.values())


def output(key: int, text: str, token_ids: list[int], finish: int = 0) -> OutputBatch:
    return OutputBatch([StreamOutput(key, text, token_ids, finish_from_proto(finish), 3, 3, 0)])


def test_a_request_fails_over_with_what_the_client_has_and_ignores_its_old_key():
    """Its replica is lost, then its scheduler: each time it is submitted again under a new key
    with the tokens (and the length of text) that reached the client; outputs under an old key
    are ignored; the client sees one uninterrupted stream."""

    async def main():
        f, scheduler = await serving_frontend(object(), failover_scheduler(), ("d:1", "d:2", "d:3"))
        request = GenerationRequest([1, 2, 3], SamplingParams(max_tokens=5))
        client = asyncio.create_task(drain(f.generate(request)))
        await eventually(lambda: routed(f))  # submitted, and the frontend knows the replica it went to
        first = scheduler.submitted[0].frontend_key
        f.dispatch(output(first, "Hel", [5, 6]))
        f.replica_lost("d:1", "the detokenizer serving this request became unavailable")
        await eventually(lambda: len(scheduler.submitted) == 2)
        second = scheduler.submitted[1]
        assert second.frontend_key != first and list(second.prompt_token_ids) == [1, 2, 3]
        assert list(second.resumed_output_token_ids) == [5, 6] and second.resumed_text_length == 3
        await eventually(lambda: scheduler.aborted == [first])  # the old group stops computing it
        f.dispatch(output(first, "STALE", [9]))  # a late output under the old key: ignored
        f.dispatch(output(second.frontend_key, "lo", [7]))
        group = f.schedulers.groups["s:1"]
        f.scheduler_lost(group)  # now its scheduler goes
        await eventually(lambda: len(scheduler.submitted) == 3)
        third = scheduler.submitted[2]
        assert list(third.resumed_output_token_ids) == [5, 6, 7] and third.resumed_text_length == 5
        f.dispatch(output(third.frontend_key, " you", [8, 9], common_pb2.FINISH_REASON_LENGTH))
        responses = await client
        assert "".join(r.text for r in responses) == "Hello you"
        assert [t for r in responses for t in r.token_ids] == [5, 6, 7, 8, 9]
        assert responses[-1].finish_reason is FinishReason.LENGTH
        await eventually(lambda: not f.background)
        assert not f.outboxes and group.in_flight == 0
        await f.schedulers.close()

    asyncio.run(main())


def test_a_failover_that_finds_no_taker_fails_unavailable_after_the_bounded_wait():
    async def main():
        f, scheduler = await serving_frontend(object(), failover_scheduler(), ("d:1", "d:2", "d:3"),
                                              failover_timeout_s=0.2)
        request = GenerationRequest([1, 2, 3], SamplingParams(max_tokens=5))
        client = asyncio.create_task(drain(f.generate(request)))
        await eventually(lambda: routed(f))
        scheduler.refuse = True
        f.replica_lost("d:1", "the detokenizer serving this request became unavailable")
        with pytest.raises(RequestError) as err:
            await client
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        await eventually(lambda: not f.background)
        assert not f.outboxes and f.schedulers.groups["s:1"].in_flight == 0
        await f.schedulers.close()

    asyncio.run(main())


def test_a_resumable_error_merged_with_an_unread_output_carries_no_finish():
    """The lost replica's error (finish ABORT on the wire) lands while the client has not read the
    previous output: what the client then reads has that output's text, but no finish reason and
    no usage, and the request goes on."""
    from vmesh.services.frontend.outbox import Outbox

    f = make_frontend(object(), ModelLimits("m", 100, 50))
    box = Outbox(delta_text=True)
    key = f.register(box)
    f.dispatch(output(key, "Hel", [5, 6]))
    f.dispatch(OutputBatch([StreamOutput(key, "", [], FinishReason.ABORT, 3, 2, 0,
                                          error="the scheduler's stream to this detokenizer closed", resumable=True)]))
    merged = asyncio.run(box.get())
    assert merged.text == "Hel" and merged.token_ids == [5, 6] and merged.lost == "scheduler"
    assert merged.finish_reason is None and merged.usage is None
