"""DetokenizerRouter on its own: routes and stream handles, batches per replica written in order,
and the replicas' word (draining, stop strings, orphans) or loss; driven without a network."""
from __future__ import annotations

import asyncio

from tests.support.eventually import eventually
from tests.support.grpc_fakes import FakeChannel, FakeStream
from vmesh.services.common.runtime.retry import Backoff
from vmesh.services.common.types import (
    FinishReason,
    RequestRef,
    SamplingParams,
    StepTokens,
    StreamStart,
    TokenLogprobs,
)
from vmesh.services.scheduler.detokenizer_router import DetokenizerRouter
from vmesh.services.scheduler.scheduler import RequestUpdate
from vmesh.v1 import common_pb2, detokenizer_pb2


class Harness:
    """A router whose streams are FakeStreams, recording what it releases on its own account."""

    def __init__(self) -> None:
        self.streams: dict[str, list[FakeStream]] = {}
        self.released: list[tuple[str, FinishReason]] = []
        self.router = DetokenizerRouter(lambda key, reason: self.released.append((key, reason)), self._open,
                                        reconnect=Backoff.none())

    def _open(self, address: str):
        stream = FakeStream()
        self.streams.setdefault(address, []).append(stream)
        return stream, FakeChannel()

    def route(self, key: str, address: str, frontend_key: int = 0):
        return self.router.open_route(key, self.router.replicas.members[address],
                                      StreamStart(RequestRef("f", frontend_key), [], SamplingParams(), 3))


def update(key: str, tokens: list[int], finish: FinishReason | None = None) -> RequestUpdate:
    return RequestUpdate(key, tokens, finish)


def test_a_request_is_introduced_once_with_its_stream_handle_ahead_of_its_tokens():
    async def main() -> None:
        h = Harness()
        await h.router.connect(["d:1"])
        a, b = h.route("f/1", "d:1", frontend_key=1), h.route("f/2", "d:1", frontend_key=2)
        assert a.stream_handle != b.stream_handle
        h.router.add_update(a, update("f/1", [5, 6]))
        await h.router.flush()
        h.router.add_update(a, update("f/1", [7], FinishReason.LENGTH))
        h.router.add_update(b, RequestUpdate("f/2", [8], logprobs=[TokenLogprobs(-0.5, 1, [8, 9], [-0.5, -1.5])]))
        await h.router.flush()
        first, second = h.streams["d:1"][0].messages
        assert [(i.handle, i.frontend_key) for i in first.new_requests] == [(a.stream_handle, 1)]
        assert list(first.handles) == [a.stream_handle] and list(first.token_ids) == [5, 6]
        assert [i.handle for i in second.new_requests] == [b.stream_handle]  # a is not introduced again
        assert list(second.handles) == [a.stream_handle, b.stream_handle] and list(second.num_tokens) == [1, 1]
        assert list(second.logprobs_handles) == [b.stream_handle] and list(second.logprobs.num_top) == [2]
        assert list(second.logprobs.top_token_ids) == [8, 9] and list(second.logprobs.sampled_ranks) == [1]
        assert list(second.finish_reasons) == [common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_UNSPECIFIED]
        h.router.close()

    asyncio.run(main())


def test_an_aborted_request_that_never_produced_a_token_is_introduced_and_ended():
    async def main() -> None:
        h = Harness()
        await h.router.connect(["d:1"])
        h.route("f/1", "d:1")
        route = h.router.close_route("f/1")
        assert h.router.close_route("f/1") is None  # released once
        h.router.add_end(route, error="the worker went away")
        await h.router.flush()
        (message,) = h.streams["d:1"][0].messages
        assert [i.handle for i in message.new_requests] == [route.stream_handle]
        assert list(message.finish_reasons) == [common_pb2.FINISH_REASON_ABORT]
        assert list(message.errors) == ["the worker went away"]
        assert h.router.replicas.members["d:1"].outstanding == 0 and h.released == []
        h.router.close()

    asyncio.run(main())


def test_concurrent_flushes_write_one_at_a_time_and_in_order():
    async def main() -> None:
        h = Harness()
        await h.router.connect(["d:1"])
        replica = h.router.replicas.members["d:1"]
        flushes = []
        for handle in range(6):  # abort RPCs and the engine loop each flush whatever is pending, concurrently
            replica.pending.requests.append(StepTokens(handle, []))
            flushes.append(asyncio.create_task(h.router.flush()))
            await asyncio.sleep(0)
        await asyncio.gather(*flushes)
        assert replica.alive
        assert h.streams["d:1"][0].received == [[handle] for handle in range(6)]
        h.router.close()

    asyncio.run(main())


def test_stop_strings_and_orphans_release_their_requests():
    async def main() -> None:
        h = Harness()
        await h.router.connect(["d:1"])
        stopped, orphaned, kept = (h.route(f"f/{i}", "d:1") for i in range(3))
        h.streams["d:1"][0].responses.put_nowait(detokenizer_pb2.DetokenizeResponse(
            stopped_handles=[stopped.stream_handle], orphaned_handles=[orphaned.stream_handle, 999]))  # 999: unknown
        await eventually(lambda: len(h.released) == 2)
        assert h.released == [("f/0", FinishReason.STOP), ("f/1", FinishReason.ABORT)]
        assert set(h.router.routes) == {"f/2"} and h.router.request_key_of == {kept.stream_handle: "f/2"}
        assert h.router.replicas.members["d:1"].outstanding == 1
        h.router.close()

    asyncio.run(main())


def test_a_lost_stream_releases_its_requests_and_reconnects():
    async def main() -> None:
        h = Harness()
        await h.router.connect(["d:1", "d:2"])
        h.route("f/1", "d:1")
        h.route("f/2", "d:2")
        first = h.streams["d:1"][0]
        first.responses.put_nowait(ConnectionError("reset by peer"))
        await eventually(lambda: first.cancelled and h.released and len(h.streams["d:1"]) == 2)
        assert first.cancelled and h.released == [("f/1", FinishReason.ABORT)]
        assert set(h.router.routes) == {"f/2"}
        assert len(h.streams["d:1"]) == 2  # reopened
        assert [r.address for r in h.router.routable()] == ["d:1", "d:2"]
        h.router.close()

    asyncio.run(main())


def test_a_draining_replica_is_not_routable_until_it_restarts():
    async def main() -> None:
        h = Harness()
        await h.router.connect(["d:1", "d:2"])
        h.streams["d:1"][0].responses.put_nowait(detokenizer_pb2.DetokenizeResponse(draining=True))
        await eventually(lambda: [r.address for r in h.router.routable()] == ["d:2"])
        assert [r.address for r in h.router.routable()] == ["d:2"]
        assert [r.address for r in h.router.routable(["d:1"])] == []  # the frontend listens only there
        h.streams["d:1"][0].responses.put_nowait(ConnectionError("it exited"))  # ...and comes back
        await eventually(lambda: h.router.routable(["d:1"]))
        assert [r.address for r in h.router.routable(["d:1"])] == ["d:1"]
        h.router.close()

    asyncio.run(main())


def test_a_leaving_replica_gets_its_last_outputs_out_and_is_let_go():
    async def main() -> None:
        h = Harness()
        await h.router.connect(["d:1"])
        h.route("f/1", "d:1")
        h.router.replicas.update(["d:2"], ["d:1"])
        await h.router.connect(["d:2"])
        leaving = h.router.replicas.members["d:1"]
        assert leaving.retired and leaving.alive  # f/1 still streams there
        assert [r.address for r in h.router.routable()] == ["d:2"]
        route = h.router.close_route("f/1")
        h.router.add_end(route)  # its last output is queued for the leaving replica...
        assert "d:1" in h.router.replicas
        await h.router.flush()  # ...and written before the replica is let go
        assert h.streams["d:1"][0].received == [[route.stream_handle]]
        assert "d:1" not in h.router.replicas and not leaving.alive
        await eventually(leaving.task.done)
        assert leaving.task.done()
        h.router.close()

    asyncio.run(main())


def test_start_up_does_not_wait_for_a_replica_that_left_before_it_answered():
    asked = asyncio.Event()

    class NeverAnswers(FakeStream):
        async def wait_for_connection(self) -> None:
            asked.set()
            await asyncio.Event().wait()

    async def main() -> None:
        h = Harness()
        h._open = lambda address: (NeverAnswers(), FakeChannel())
        h.router = DetokenizerRouter(lambda key, reason: None, h._open, reconnect=Backoff.none())
        connecting = asyncio.create_task(h.router.connect(["d:1"]))
        await asked.wait()  # start-up waits on the replica's answer...
        assert not connecting.done()
        h.router.replicas.update([], ["d:1"])
        await asyncio.wait_for(connecting, 1)
        assert "d:1" not in h.router.replicas
        h.router.close()

    asyncio.run(main())
