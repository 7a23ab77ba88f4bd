"""Each step costs a fixed number of messages on every link, whatever the batch holds: one
token batch per detokenizer replica (scheduler -> detokenizer) and one output batch per frontend
(detokenizer -> frontend), for one request or a hundred. The scheduler -> worker link's one plan
per step is checked with the real scheduler in test_pipeline_stays_full.py."""
from __future__ import annotations

import asyncio

import pytest

from tests.support.grpc_fakes import FakeChannel, FakeStream
from vmesh.services.common.runtime.retry import Backoff
from vmesh.services.common.types import (
    FinishReason,
    RequestRef,
    SamplingParams,
    StepTokens,
    StreamStart,
    TokenBatch,
)
from vmesh.services.common.wire import tokens
from vmesh.services.detokenizer.output_processor import OutputProcessor
from vmesh.services.detokenizer.server import DetokenizerServicer
from vmesh.services.scheduler.detokenizer_router import DetokenizerRouter
from vmesh.services.scheduler.scheduler import RequestUpdate

REPLICAS = ["d:1", "d:2", "d:3"]
FRONTENDS = ["f0", "f1"]
STEPS = 4


@pytest.mark.parametrize("num_requests", [1, 7, 100])
def test_the_scheduler_writes_one_batch_per_replica_per_step(num_requests):
    streams: dict[str, list[FakeStream]] = {}

    def open_stream(address: str):
        stream = FakeStream()
        streams.setdefault(address, []).append(stream)
        return stream, FakeChannel()

    async def main() -> None:
        router = DetokenizerRouter(lambda key, reason: None, open_stream, reconnect=Backoff.none())
        await router.connect(REPLICAS)
        routes = [router.open_route(f"f/{i}", router.replicas.members[REPLICAS[i % len(REPLICAS)]],
                                    StreamStart(RequestRef("f", i), [], SamplingParams(), 3))
                  for i in range(num_requests)]
        for step in range(STEPS):
            last = step == STEPS - 1
            for route in routes:
                router.add_update(route, RequestUpdate(f"f/{route.stream_handle}", [step + 5],
                                                       FinishReason.LENGTH if last else None))
            await router.flush()
        busy = REPLICAS[:min(num_requests, len(REPLICAS))]
        assert {a: len(s[0].messages) for a, s in streams.items() if s[0].messages} == {a: STEPS for a in busy}
        per_replica = [sum(len(m.handles) for m in streams[a][0].messages) for a in busy]
        assert sum(per_replica) == num_requests * STEPS  # every update went out, batched
        router.close()

    asyncio.run(main())


@pytest.mark.parametrize("num_requests", [1, 7, 100])
def test_a_replica_publishes_one_batch_per_frontend_per_step(embedded_tokenizer, num_requests):
    tok = embedded_tokenizer.backend_tokenizer
    servicer = DetokenizerServicer(tok)
    queues = {f: asyncio.Queue() for f in FRONTENDS}
    servicer.subscribers.update(queues)
    requests: OutputProcessor[int] = OutputProcessor(tok)
    word = tok.encode(" hello", add_special_tokens=False).ids
    for step in range(STEPS):
        batch = TokenBatch(
            new_requests=[StreamStart(RequestRef(FRONTENDS[i % len(FRONTENDS)], i), [1], SamplingParams(), 1, handle=i)
                          for i in range(num_requests)] if step == 0 else [],
            requests=[StepTokens(i, word, FinishReason.LENGTH if step == STEPS - 1 else None)
                      for i in range(num_requests)])
        servicer.process(tokens.to_proto(batch), requests)
    busy = FRONTENDS[:min(num_requests, len(FRONTENDS))]
    assert {f: q.qsize() for f, q in queues.items() if q.qsize()} == {f: STEPS for f in busy}
    delivered = sum(len(queues[f].get_nowait().texts) for f in busy for _ in range(STEPS))
    assert delivered == num_requests * STEPS
    assert len(requests) == 0  # every request finished and was released
