"""The peer runtime's small parts on their own: the backoff policy, the task group, the drain
wait, a kept-open stream's reopening, and the ready files."""
from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable

import pytest

from vmesh.services.common.runtime.peers import Peer
from vmesh.services.common.runtime.readiness import Announcement, ReadyFiles, announce
from vmesh.services.common.runtime.retry import Backoff
from vmesh.services.common.runtime.stream import KeptStream
from vmesh.services.common.runtime.tasks import TaskGroup, wait_until


def test_backoff_grows_by_its_factor_up_to_its_cap():
    backoff = Backoff(0.5, factor=2.0, max_s=10.0)
    assert [backoff.delay(n) for n in (0, 1, 2, 3, 6, 50)] == [0.5, 0.5, 1.0, 2.0, 10.0, 10.0]
    assert Backoff(1.0).delay(7) == 1.0  # the default is a fixed delay
    assert Backoff.none().delay(3) == 0.0


def test_a_task_group_holds_its_tasks_until_done_and_cancels_the_rest():
    async def main() -> None:
        group = TaskGroup()
        release = asyncio.Event()
        quick, waiting = group.spawn(asyncio.sleep(0)), group.spawn(release.wait())
        assert len(group) == 2
        await quick
        await asyncio.sleep(0)
        assert list(group) == [waiting]
        group.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert not group

    asyncio.run(main())


def test_settling_a_task_group_lets_work_finish_then_cancels_and_collects_the_rest():
    """What a frontend's close does with its aborts in flight: the ones that end within the time
    given end (their effect happens), the rest are cancelled, and a failure is collected rather
    than reported at exit as an exception never retrieved."""
    async def main() -> None:
        group = TaskGroup()
        finished: list[str] = []

        async def slow_but_in_time() -> None:
            await asyncio.sleep(0.05)
            finished.append("in time")

        async def fails() -> None:
            raise RuntimeError("its scheduler is gone")

        in_time, stuck = group.spawn(slow_but_in_time()), group.spawn(asyncio.Event().wait())
        group.spawn(fails())  # unreferenced here, as a frontend's aborts are
        loop = asyncio.get_running_loop()
        unretrieved: list[dict] = []
        loop.set_exception_handler(lambda _loop, context: unretrieved.append(context))
        started = loop.time()
        await group.settle(timeout=0.5)
        assert finished == ["in time"] and in_time.done() and not in_time.cancelled()
        assert stuck.cancelled() and 0.5 <= loop.time() - started < 5 and not group
        await group.settle(timeout=0.5)  # nothing left: returns at once
        gc.collect()
        assert unretrieved == []

    asyncio.run(main())


def test_wait_until_returns_once_the_condition_holds():
    async def main() -> None:
        work = [1, 2]

        async def finish() -> None:
            while work:
                await asyncio.sleep(0)
                work.pop()

        finishing = asyncio.create_task(finish())
        await asyncio.wait_for(wait_until(lambda: not work, poll_s=0), 10)
        await finishing

    asyncio.run(main())


def test_a_kept_stream_reopens_after_each_break_until_told_to_stop():
    async def main() -> tuple[list[str], Peer]:
        peer = Peer("a:1")
        events: list[str] = []

        async def session(opened: Callable[[], None]) -> None:
            events.append("open")
            if len(events) > 1:  # the first attempt fails before the stream is up
                opened()
                assert peer.alive and peer.joined.is_set()
            raise ConnectionError("reset")

        async def lost(exc: Exception) -> bool:
            peer.alive = False
            events.append(str(exc))
            return len(events) < 6

        await asyncio.wait_for(KeptStream(peer, session, lost, Backoff.none()).run(), 10)
        return events, peer

    events, peer = asyncio.run(main())
    assert events == ["open", "reset", "open", "reset", "open", "reset"] and not peer.alive


def test_ready_files_are_announced_whole_and_cleared_together(tmp_path):
    ready = ReadyFiles(tmp_path / "ready")
    assert ready.read() is None and not ready.written()
    announce(None, Announcement.HTTP, "ignored")  # no ready file given: nothing to write
    announce(tmp_path / "ready", Announcement.HTTP, "127.0.0.1:8000")
    ready.write(Announcement.ADDRESS, "127.0.0.1:5000")
    assert ready.read(Announcement.HTTP) == "127.0.0.1:8000" and ready.read() == "127.0.0.1:5000"
    assert ready.file(Announcement.MESH_DESCRIPTION) == tmp_path / "ready.mesh.json"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ready", "ready.http"]  # no staging file left
    ready.clear()
    assert list(tmp_path.iterdir()) == []
