"""The frontend's choice among scheduler groups (data parallelism), without a network."""
from __future__ import annotations

import asyncio

from services.frontend.schedulers import SchedulerPool
from vmesh.v1 import scheduler_pb2


class FakeScheduler:
    def __init__(self, model: str):
        self.model = model

    async def GetSchedulerStats(self, request, **kwargs):
        return scheduler_pb2.GetSchedulerStatsResponse(model_name=self.model, max_model_len=2048, vocab_size=100)


class FakeChannel:
    closed = False

    async def close(self) -> None:
        self.closed = True


def pool_of(models: dict[str, str]) -> tuple[SchedulerPool, dict[str, FakeChannel]]:
    channels = {address: FakeChannel() for address in models}
    return SchedulerPool(lambda address: (FakeScheduler(models[address]), channels[address])), channels


def test_requests_go_to_the_least_busy_group_serving_the_same_model():
    async def main() -> None:
        pool, _ = pool_of({"a:1": "m", "b:1": "m", "c:1": "other"})
        groups = [pool.add(address) for address in ("a:1", "b:1", "c:1")]
        await asyncio.gather(*(g.joined.wait() for g in groups))
        assert pool.limits.name == "m"
        assert [g.address for g in pool.candidates()] == ["a:1", "b:1"]  # c serves another model
        a, b = pool.candidates()
        pool.acquire(a)
        pool.acquire(a)
        pool.acquire(b)
        assert pool.candidates()[0] is b
        pool.release(a)
        pool.release(a)
        assert pool.candidates()[0] is a

    asyncio.run(main())


def test_a_group_that_leaves_takes_no_new_requests_and_closes_when_idle():
    async def main() -> None:
        pool, channels = pool_of({"a:1": "m", "b:1": "m"})
        a, b = pool.add("a:1"), pool.add("b:1")
        await asyncio.gather(a.joined.wait(), b.joined.wait())
        pool.acquire(a)
        pool.remove("a:1")
        assert pool.candidates() == [b] and "a:1" in pool.groups
        pool.release(a)  # its last request ended
        await asyncio.sleep(0)
        assert "a:1" not in pool.groups and channels["a:1"].closed
        pool.remove("b:1")  # idle already: closed at once
        await asyncio.sleep(0)
        assert pool.groups == {} and channels["b:1"].closed

    asyncio.run(main())


def test_a_group_that_is_not_ready_yet_is_asked_again(monkeypatch):
    import grpc

    from services.frontend import schedulers

    monkeypatch.setattr(schedulers, "JOIN_RETRY_S", 0.0)

    class StartingScheduler(FakeScheduler):
        calls = 0

        async def GetSchedulerStats(self, request, **kwargs):
            self.calls += 1
            if self.calls == 1:  # its worker is still loading
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           "not connected to a worker yet")
            return await super().GetSchedulerStats(request, **kwargs)

    async def main() -> None:
        stub = StartingScheduler("m")
        pool = SchedulerPool(lambda address: (stub, FakeChannel()))
        group = pool.add("a:1")
        for _ in range(20):
            await asyncio.sleep(0)
        assert stub.calls == 2 and group.ready and pool.candidates() == [group]

    asyncio.run(main())
