"""Limits the frontend's request path enforces before any expensive step: token-id prompts
longer than the context, a deadline already passed, a drain that began during tokenization."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from tests.support.fake_scheduler import FakeScheduler
from tests.support.frontends import make_frontend, serving_frontend
from vmesh.services.common.generation import GenerationRequest
from vmesh.services.common.types import ModelLimits
from vmesh.services.frontend.errors import RequestError


async def drain(stream) -> list:
    return [x async for x in stream]


class NoCopies:
    """Token ids that must not be copied (only their count read)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        raise AssertionError("copied before the length was checked")


def test_token_id_prompts_longer_than_the_context_are_refused_before_any_copy():
    f = make_frontend(object(), ModelLimits("m", max_model_len=100, vocab_size=10))
    with pytest.raises(RequestError) as err:
        asyncio.run(f.encode(NoCopies(50_000_000)))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "50000000 tokens" in err.value.message


class Tokenizer:
    def __init__(self, on_encode=lambda: None):
        self.on_encode = on_encode

    def encode(self, text: str) -> list[int]:
        self.on_encode()
        return [1, 2]


def test_a_deadline_that_passed_before_submission_is_deadline_exceeded():
    async def main() -> None:
        f, _ = await serving_frontend(Tokenizer(), FakeScheduler(ModelLimits("m", 100, 10)))
        await drain(f.generate(GenerationRequest("hi"), time_remaining=lambda: 0.0))

    with pytest.raises(RequestError) as err:
        asyncio.run(main())
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_a_drain_that_began_during_tokenization_refuses_the_request():
    """Drain waits for requests in flight; one still tokenizing was not counted, so it must not
    start once tokenized (it would be cut off when the server stops)."""
    f = make_frontend(None, ModelLimits("m", 100, 10))
    f.tokenizer = Tokenizer(on_encode=lambda: setattr(f, "draining", True))
    with pytest.raises(RequestError) as err:
        asyncio.run(drain(f.generate(GenerationRequest("hi"))))
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and "draining" in err.value.message
    assert f.in_flight == 0


def test_a_failed_submission_does_not_show_internal_addresses():
    """gRPC's own text names addresses inside the mesh; the client gets the gist."""
    from tests.support.grpc_fakes import rpc_error

    class DownScheduler(FakeScheduler):
        async def SubmitRequest(self, request, **kwargs):
            raise rpc_error(grpc.StatusCode.UNAVAILABLE,
                            "failed to connect to all addresses; last error: ipv4:10.1.2.3:50052: Connection refused")

    async def main() -> RequestError:
        # No wait for a group to come back: the refusal is the answer under test.
        f, _ = await serving_frontend(Tokenizer(), DownScheduler(ModelLimits("m", 100, 10)), failover_timeout_s=0)
        try:
            await drain(f.generate(GenerationRequest("hi")))
        except RequestError as exc:
            return exc
        finally:
            await f.schedulers.close()
        raise AssertionError("the submission did not fail")

    error = asyncio.run(main())
    assert error.code == grpc.StatusCode.UNAVAILABLE
    assert "10.1.2.3" not in error.message and "ipv4" not in error.message
