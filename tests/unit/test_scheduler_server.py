"""The scheduler service over its DetokenizerRouter: where submissions go, what a replica's word or loss
does to the scheduler's queues, and refused submissions; driven without a network."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from tests.support.grpc_fakes import Aborted, FakeChannel, FakeContext, FakeStream
from vmesh.services.common.request_checks import MAX_STOP_TOKEN_IDS, ModelLimits
from vmesh.services.scheduler import detokenizer_router
from vmesh.services.scheduler.block_pool import BlockPool
from vmesh.services.scheduler.scheduler import Scheduler, SchedulerConfig
from vmesh.services.scheduler.server import MeshSchedulerConfig, SchedulerServicer
from vmesh.v1 import common_pb2, detokenizer_pb2, scheduler_pb2


class Servicer(SchedulerServicer):
    """Streams to fake replicas; addresses resolve through `dns`."""

    def __init__(self, addresses: list[str]):
        super().__init__(MeshSchedulerConfig(worker_addresses=[], detokenizer_addresses=addresses),
                         open_detokenizer_stream=self._open_stream)
        self.streams: dict[str, list[FakeStream]] = {}
        self.scheduler = Scheduler(SchedulerConfig(max_model_len=64), BlockPool(16, 4), (0,))
        self.limits = ModelLimits("tiny", max_model_len=64, vocab_size=100)

    def _open_stream(self, address: str):
        stream = FakeStream()
        self.streams.setdefault(address, []).append(stream)
        return stream, FakeChannel()

    async def submit(self, frontend_key: int, detokenizers: tuple[str, ...] = ()) -> str:
        reply = await self.SubmitRequest(scheduler_pb2.SubmitRequestRequest(
            frontend_id="f", frontend_key=frontend_key, prompt_token_ids=[1, 2, 3],
            detokenizers=detokenizers), FakeContext())
        return reply.detokenizer


async def connected(servicer: Servicer) -> None:
    await servicer.router.connect(servicer.detokenizers.addresses)


def test_requests_go_only_to_replicas_the_frontend_listens_to():
    async def main() -> None:
        servicer = Servicer(["127.0.0.1:1", "127.0.0.1:2"])
        await connected(servicer)
        picks = {await servicer.submit(i, ("127.0.0.1:2",)) for i in range(4)}
        assert picks == {"127.0.0.1:2"}
        # unrestricted requests spread by least outstanding: the idle replica catches up first
        assert [await servicer.submit(10 + i) for i in range(4)] == ["127.0.0.1:1"] * 4
        with pytest.raises(Aborted) as err:
            await servicer.submit(20, ("127.0.0.1:9",))
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        await servicer.close()

    asyncio.run(main())


def test_a_replica_that_leaves_finishes_its_requests_and_then_closes():
    async def main() -> None:
        servicer = Servicer(["127.0.0.1:1"])
        await connected(servicer)
        assert await servicer.submit(0) == "127.0.0.1:1"
        servicer.router.replicas.update(["127.0.0.1:2"], ["127.0.0.1:1"])
        await servicer.router.replicas.members["127.0.0.1:2"].connected.wait()
        leaving = servicer.router.replicas.members["127.0.0.1:1"]
        assert leaving.retired and leaving.alive  # r0 still streams there
        assert await servicer.submit(1) == "127.0.0.1:2"
        r0 = servicer._release("f/0")
        servicer.router.add_end(r0)  # its last output is queued for the leaving replica...
        assert "127.0.0.1:1" in servicer.router.replicas
        await servicer.router.flush()  # ...and written before the replica is let go
        assert servicer.streams["127.0.0.1:1"][0].received == [[r0.stream_handle]]
        assert "127.0.0.1:1" not in servicer.router.replicas
        await asyncio.sleep(0)
        assert leaving.task.done()
        await servicer.close()

    asyncio.run(main())


def test_a_lost_stream_fails_its_requests_and_reconnects(monkeypatch):
    monkeypatch.setattr(detokenizer_router, "RECONNECT_DELAY_S", 0.0)

    async def main() -> None:
        servicer = Servicer(["127.0.0.1:1"])
        await connected(servicer)
        await servicer.submit(0)
        first = servicer.streams["127.0.0.1:1"][0]
        first.responses.put_nowait(ConnectionError("reset by peer"))
        for _ in range(50):
            await asyncio.sleep(0)
        assert first.cancelled
        assert "f/0" not in servicer.router.routes and not servicer.scheduler.has_unfinished()
        assert len(servicer.streams["127.0.0.1:1"]) == 2  # reopened
        assert servicer.router.replicas.members["127.0.0.1:1"].alive
        assert await servicer.submit(1) == "127.0.0.1:1"
        await servicer.close()

    asyncio.run(main())


def test_a_draining_replica_gets_no_new_requests_until_it_restarts(monkeypatch):
    monkeypatch.setattr(detokenizer_router, "RECONNECT_DELAY_S", 0.0)

    async def main() -> None:
        servicer = Servicer(["127.0.0.1:1", "127.0.0.1:2"])
        await connected(servicer)
        servicer.streams["127.0.0.1:1"][0].responses.put_nowait(detokenizer_pb2.DetokenizeResponse(
            draining=True))
        for _ in range(10):
            await asyncio.sleep(0)
        assert servicer.router.replicas.members["127.0.0.1:1"].draining
        assert {await servicer.submit(i) for i in range(3)} == {"127.0.0.1:2"}
        servicer.streams["127.0.0.1:1"][0].responses.put_nowait(ConnectionError("it exited"))  # ...and comes back
        for _ in range(50):
            await asyncio.sleep(0)
        assert len(servicer.streams["127.0.0.1:1"]) == 2
        assert await servicer.submit(3) == "127.0.0.1:1"
        await servicer.close()

    asyncio.run(main())


def test_requests_the_detokenizer_reports_orphaned_are_stopped():
    async def main() -> None:
        servicer = Servicer(["127.0.0.1:1"])
        await connected(servicer)
        await servicer.submit(0)
        await servicer.submit(1)
        handle = servicer.router.routes["f/0"].stream_handle
        servicer.streams["127.0.0.1:1"][0].responses.put_nowait(detokenizer_pb2.DetokenizeResponse(
            orphaned_handles=[handle, 999]))  # 999: unknown, or already gone
        for _ in range(10):
            await asyncio.sleep(0)
        assert "f/0" not in servicer.router.routes and "f/1" in servicer.router.routes
        assert servicer.scheduler.stats().num_waiting == 1
        assert servicer.router.replicas.members["127.0.0.1:1"].outstanding == 1
        await servicer.close()

    asyncio.run(main())


BAD_SUBMISSIONS = [
    (dict(prompt_token_ids=[]), "prompt"),
    (dict(prompt_token_ids=[1, 100]), "token_ids"),
    (dict(prompt_token_ids=list(range(64))), "prompt"),
    (dict(sampling=common_pb2.SamplingParams(temperature=float("nan"))), "temperature"),
    (dict(sampling=common_pb2.SamplingParams(repetition_penalty=float("inf"))), "repetition_penalty"),
    (dict(sampling=common_pb2.SamplingParams(max_tokens=100)), "max_tokens"),
    (dict(sampling=common_pb2.SamplingParams(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1))), "stop_token_ids"),
    (dict(sampling=common_pb2.SamplingParams(stop_token_ids=[100])), "stop_token_ids"),
]


@pytest.mark.parametrize(("fields", "name"), BAD_SUBMISSIONS, ids=[n for _, n in BAD_SUBMISSIONS])
def test_a_submission_the_worker_cannot_serve_is_refused_alone(fields, name):
    """Whoever calls SubmitRequest, a request outside the model's limits never reaches the worker's
    shared step: it is refused with INVALID_ARGUMENT and nothing is queued."""
    async def main() -> None:
        servicer = Servicer(["127.0.0.1:1"])
        await connected(servicer)
        request = scheduler_pb2.SubmitRequestRequest(frontend_id="f", frontend_key=1,
                                                     prompt_token_ids=[1, 2, 3])
        request.MergeFrom(scheduler_pb2.SubmitRequestRequest(**fields))
        if "prompt_token_ids" in fields:
            request.prompt_token_ids[:] = fields["prompt_token_ids"]
        with pytest.raises(Aborted) as refused:
            await servicer.SubmitRequest(request, FakeContext())
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and name in str(refused.value)
        assert not servicer.scheduler.has_unfinished() and not servicer.router.routes
        assert await servicer.submit(2)  # the next one is served
        await servicer.close()

    asyncio.run(main())
