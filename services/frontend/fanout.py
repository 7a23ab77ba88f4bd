"""The streams of one HTTP request (n choices, several prompts) merged into one, and what ends
them when the client leaves."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from vmesh.services.common.generation import GenerationOutput

T = TypeVar("T")


class Fanout:
    """Several request streams (n choices, several prompts) merged into one sequence of
    (choice index, GenerationOutput).

    The queue is bounded: a stream whose output the reader has not taken yet stops pulling, so
    outputs that arrive meanwhile merge in the request's one-slot Outbox rather than pile up
    here. A slow reader then holds at most a few entries per stream, never tokens × n of them."""

    def __init__(self, streams: list[AsyncGenerator[GenerationOutput, None]]):
        self.queue: asyncio.Queue[tuple[int, GenerationOutput | None, BaseException | None]] = (
            asyncio.Queue(maxsize=max(1, len(streams))))
        # One stream (most requests) is read in the reader's own task: no pump task and no queue
        # between them, which would cost a task switch and two queue operations per output.
        self.single = streams[0] if len(streams) == 1 else None
        self.tasks = [] if self.single is not None else [asyncio.create_task(self._pump(i, s))
                                                         for i, s in enumerate(streams)]
        self.pending: list[tuple[int, GenerationOutput]] = []
        self.open = len(streams)

    async def _pump(self, index: int, stream: AsyncGenerator[GenerationOutput, None]) -> None:
        try:
            try:
                async for out in stream:
                    await self.queue.put((index, out, None))
            finally:
                # Cancelled while waiting for room in the queue, the stream sits at a yield where
                # the cancellation never reaches it: closing it runs its cleanup (the abort) now.
                await stream.aclose()
            await self.queue.put((index, None, None))
        except Exception as exc:  # handed to the reader, which raises it
            await self.queue.put((index, None, exc))

    async def _next(self) -> tuple[int, GenerationOutput] | None:
        if self.single is not None:
            if self.open:
                try:
                    return 0, await anext(self.single)
                except StopAsyncIteration:
                    self.open = 0
            return None
        while self.open:
            index, out, error = await self.queue.get()
            if error is not None:
                raise error
            if out is None:
                self.open -= 1
                continue
            return index, out
        return None

    async def started(self) -> None:
        """Wait for the first output or the first error, so that a request refused by validation
        or a full queue fails with an HTTP status before any streamed byte, without holding every
        choice back until the slowest has started; keeps what came. A later failure is sent as
        an error event."""
        item = await self._next()
        if item is not None:
            self.pending.append(item)

    async def events(self) -> AsyncIterator[tuple[int, GenerationOutput]]:
        while self.pending:
            yield self.pending.pop(0)
        if self.single is not None and self.open:
            async for out in self.single:
                yield 0, out
            self.open = 0
        while (item := await self._next()) is not None:
            yield item

    async def close(self) -> None:
        """Cancel what still runs: each stream's request is then aborted in the scheduler. Safe
        to call more than once."""
        if self.single is not None:
            await self.single.aclose()  # runs its cleanup (the abort) unless it has ended
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


class FanoutStreamingResponse(StreamingResponse):
    """Closes its fan-out however the response ends: Starlette may cancel the body before its
    generator has started (the client left right after the response started), and a generator
    that never started never runs its `finally`."""

    def __init__(self, fanout: Fanout, content: AsyncIterator[str], **kwargs: Any):
        super().__init__(content, **kwargs)
        self.fanout = fanout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.fanout.close()


class ClientGone(Exception):
    pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run `work` unless the client disconnects first: then it is cancelled (which aborts its
    requests) and ClientGone raised. The body has been read, so the next ASGI message the
    server hands over is the disconnect."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        # Our own cancellation (uvicorn shutting down, say), not the client's leaving: stop the
        # work and let the cancellation through, as swallowing it would keep this task running.
        watcher.cancel()
        task.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
        raise
    watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone
    return task.result()
