"""The frontend's choice among scheduler groups (data parallelism), without a network."""
from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health_pb2

from tests.support.eventually import eventually
from tests.support.fake_scheduler import FakeScheduler
from tests.support.grpc_fakes import FakeChannel, healthy_forever, rpc_error
from vmesh.services.common.runtime.retry import Backoff
from vmesh.services.common.types import ModelLimits
from vmesh.services.frontend.schedulers import SchedulerPool


def serving(model: str) -> FakeScheduler:
    return FakeScheduler(ModelLimits(model, 2048, 100))


def pool_of(models: dict[str, str], **kwargs) -> tuple[SchedulerPool, dict[str, FakeChannel]]:
    channels = {address: FakeChannel() for address in models}
    kwargs.setdefault("health_stream", healthy_forever)
    return SchedulerPool(lambda address: (serving(models[address]), channels[address]), **kwargs), channels


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


def test_a_group_that_is_not_ready_yet_is_asked_again():
    import grpc

    class StartingScheduler(FakeScheduler):
        calls = 0

        async def GetSchedulerStats(self, request, **kwargs):
            self.calls += 1
            if self.calls == 1:  # its worker is still loading
                raise rpc_error(grpc.StatusCode.UNAVAILABLE, "not connected to a worker yet")
            return await super().GetSchedulerStats(request, **kwargs)

    async def main() -> None:
        stub = StartingScheduler(ModelLimits("m", 2048, 100))
        pool = SchedulerPool(lambda address: (stub, FakeChannel()), join_retry=Backoff.none())
        group = pool.add("a:1")
        for _ in range(20):
            await asyncio.sleep(0)
        assert stub.calls == 2 and group.ready and pool.candidates() == [group]

    asyncio.run(main())


def test_submission_fails_over_to_the_next_group_only_when_unavailable():
    import grpc

    from tests.support.frontends import make_frontend
    from vmesh.services.common.generation import Submission
    from vmesh.services.common.types import SamplingParams
    from vmesh.services.frontend.errors import RequestError
    from vmesh.services.frontend.failover import submit as submit_request

    class Group(FakeScheduler):
        def __init__(self, error: grpc.StatusCode | None):
            super().__init__(ModelLimits("m", 2048, 100))
            self.error = error
            self.calls = 0

        async def SubmitRequest(self, request, **kwargs):
            self.calls += 1
            if self.error is not None:
                raise rpc_error(self.error)
            return await super().SubmitRequest(request, **kwargs)

    async def submit(errors: dict[str, grpc.StatusCode | None]):
        stubs = {address: Group(error) for address, error in errors.items()}
        frontend = make_frontend(scheduler=stubs, schedulers=tuple(errors))
        await frontend.join_schedulers()
        try:
            group, _ = await submit_request(frontend, Submission("", 0, [], SamplingParams()))
            return group.address, {a: (s.calls, frontend.schedulers.groups[a].in_flight) for a, s in stubs.items()}
        except RequestError as exc:
            return exc.code, {a: (s.calls, frontend.schedulers.groups[a].in_flight) for a, s in stubs.items()}

    # a:1 is down: the request goes to b:1, and only b:1 counts it in flight
    assert asyncio.run(submit({"a:1": grpc.StatusCode.UNAVAILABLE, "b:1": None})) == (
        "b:1", {"a:1": (1, 0), "b:1": (1, 1)})
    # a full queue is an answer, not an outage: no second group is tried
    assert asyncio.run(submit({"a:1": grpc.StatusCode.RESOURCE_EXHAUSTED, "b:1": None})) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED, {"a:1": (1, 0), "b:1": (0, 0)})


class Restartable(FakeScheduler):
    """A scheduler process that can die, come back as a new process, or stay the same."""

    def __init__(self, model: str):
        super().__init__(ModelLimits(model, 2048, 100))
        self.incarnation = "first"
        self.down = False

    async def GetSchedulerStats(self, request, **kwargs):
        if self.down:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE)
        stats = await super().GetSchedulerStats(request)
        stats.incarnation = self.incarnation
        return stats


async def _break_once(outcome: str) -> tuple[list, bool]:
    """a:1's connection breaks once; then its scheduler is `outcome`: the same process, a new
    one, or gone. Returns what was reported lost and whether a:1 takes requests afterwards."""
    broken = asyncio.Event()

    async def health(group):
        yield "SERVING"
        if outcome == "drained":
            yield health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.NOT_SERVING)
        await broken.wait()
        broken.clear()
        raise rpc_error(grpc.StatusCode.UNAVAILABLE)

    scheduler = Restartable("m")
    lost = []
    pool = SchedulerPool(lambda address: (scheduler if address == "a:1" else serving("m"), FakeChannel()),
                         on_lost=lost.append, loss_grace_s=0.05,
                         health_stream=lambda g: health(g) if g.address == "a:1" else healthy_forever(g))
    a, b = pool.add("a:1"), pool.add("b:1")
    await asyncio.gather(a.joined.wait(), b.joined.wait())
    await asyncio.sleep(0.01)
    assert lost == []
    if outcome == "restarted":
        scheduler.incarnation = "second"
    elif outcome in ("dead", "drained"):
        scheduler.down = True
    broken.set()
    for _ in range(50):
        await asyncio.sleep(0.01)
    ready = a in pool.candidates()
    await pool.close()
    return lost, ready


def test_a_broken_connection_to_the_same_scheduler_loses_nothing():
    """A network blip: the same process answers again, its requests are fine."""
    lost, ready = asyncio.run(_break_once("same"))
    assert lost == [] and ready


def test_a_restarted_scheduler_is_reported_lost_and_used_again():
    """A new process on the address: what the old one held is gone; the new one takes requests."""
    lost, ready = asyncio.run(_break_once("restarted"))
    assert [g.address for g in lost] == ["a:1"] and ready


def test_a_dead_scheduler_is_reported_lost_and_takes_no_new_requests():
    """The health stream breaking is how requests still queued in a dead scheduler, which no
    detokenizer knows of, are failed instead of waiting for the client's deadline."""
    lost, ready = asyncio.run(_break_once("dead"))
    assert [g.address for g in lost] == ["a:1"] and not ready


def test_a_group_that_stops_while_not_serving_is_let_go_without_an_error(caplog):
    """A scale-down: the group drained (NOT_SERVING) and held none of this frontend's requests,
    so its exit is a warning, not an error; it is treated as gone all the same."""
    with caplog.at_level(logging.INFO, logger="vmesh.services.frontend.schedulers"):
        lost, ready = asyncio.run(_break_once("drained"))
    assert [g.address for g in lost] == ["a:1"] and not ready
    levels = {r.levelname for r in caplog.records if "a:1" in r.getMessage()}
    assert "WARNING" in levels and "ERROR" not in levels


def test_a_groups_cache_view_follows_its_stream_and_is_dropped_while_it_is_down():
    from vmesh.services.common.cache_events import CacheUpdate
    from vmesh.services.common.wire.cache import cache_update_to_proto
    from vmesh.services.frontend.prefix_routing import PromptRoute

    class Watched(FakeScheduler):
        def __init__(self) -> None:
            super().__init__(ModelLimits("m", 2048, 100))
            self.streams = 0
            self.reopen = asyncio.Event()

        async def WatchCache(self, request, **kwargs):
            self.streams += 1
            if self.streams > 1:
                await self.reopen.wait()
            yield cache_update_to_proto(CacheUpdate(True, 4, 9, [1, 2], [], incarnation="x"))
            yield cache_update_to_proto(CacheUpdate(False, 4, 9, [3], [1], incarnation="x"))
            if self.streams == 1:
                raise rpc_error(grpc.StatusCode.UNAVAILABLE)
            await asyncio.Event().wait()

    async def main() -> None:
        scheduler = Watched()
        pool = SchedulerPool(lambda address: (scheduler, FakeChannel()), health_stream=healthy_forever,
                             cache_retry=Backoff.none())
        group = pool.add("a:1")
        await group.joined.wait()
        await eventually(lambda: scheduler.streams == 2)  # the first stream broke; the second waits
        assert group.cache is None  # down: routing uses the frontend's own table
        route = PromptRoute(list(range(8)))
        pool.routed(group, route)
        assert pool.candidates(route) == [group]
        scheduler.reopen.set()
        await eventually(lambda: group.cache is not None and group.cache.blocks == {2, 3})
        pool.routed(group, route)
        assert group.cache.sent_since_update == 1
        await pool.close()

    asyncio.run(main())


def test_prefix_table_routing_never_opens_a_cache_stream():
    """`--routing prefix-table`: prefix routing on the frontend's own record alone, the baseline
    the cache streams are measured against."""
    from vmesh.services.frontend.prefix_routing import PromptRoute

    class Counting(FakeScheduler):
        def __init__(self) -> None:
            super().__init__(ModelLimits("m", 2048, 100))
            self.streams = 0

        async def WatchCache(self, request, **kwargs):
            self.streams += 1
            await asyncio.Event().wait()
            yield  # pragma: no cover - a stream

    async def main() -> tuple[int, int]:
        counts = []
        for routing in ("prefix", "prefix-table"):
            schedulers = {"a:1": Counting(), "b:1": Counting()}
            pool = SchedulerPool(lambda address, s=schedulers: (s[address], FakeChannel()),
                                 health_stream=healthy_forever, routing=routing)
            group_a, group_b = pool.add("a:1"), pool.add("b:1")
            await asyncio.gather(group_a.joined.wait(), group_b.joined.wait())
            for _ in range(20):
                await asyncio.sleep(0)
            route = PromptRoute(list(range(64)))
            pool.routed(group_b, route)
            assert pool.candidates(route)[0] is group_b  # the table still routes by prefix
            counts.append(sum(s.streams for s in schedulers.values()))
            await pool.close()
        return counts[0], counts[1]

    assert asyncio.run(main()) == (2, 0)
