"""The HTTP API's connection guards on a real socket: a connection that does not send its
request's head, or then its body, in time is closed, one peer's connections past its cap are closed as they open,
and past the connection limit the API answers 503 while /health still answers."""
from __future__ import annotations

import asyncio
from typing import Any

import httpx

from tests.support.frontends import serving_frontend
from tests.unit.test_openai_http import CharTokenizer
from vmesh.services.frontend.http_server import HttpServer

HANG_S = 30  # a connection the server would never close fails the test after this, not never


async def _serving(**settings: Any) -> tuple[Any, HttpServer, str, int]:
    limit = settings.pop("limit", 4096)
    f, _ = await serving_frontend(CharTokenizer(), **settings)
    server = HttpServer(f, None, "127.0.0.1", 0, limit=limit)
    server.start()
    while not server.server.started:
        await asyncio.sleep(0.01)
    host, port = server.address.split(":")
    return f, server, host, int(port)


async def _closed_by_server(reader: asyncio.StreamReader) -> bool:
    return await asyncio.wait_for(reader.read(), HANG_S) == b""


def test_a_connection_that_trickles_its_head_is_closed_and_a_prompt_one_is_served():
    async def main():
        f, server, host, port = await _serving(http_header_timeout_s=0.3)
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # the head never ends
        closed = await _closed_by_server(reader)
        async with httpx.AsyncClient(base_url=f"http://{host}:{port}") as http:
            served = (await http.get("/health")).status_code
        await server.stop()
        await f.schedulers.close()
        return closed, served

    assert asyncio.run(main()) == (True, 200)


def test_a_kept_alive_connection_must_send_its_next_head_in_time_too():
    async def main():
        f, server, host, port = await _serving(http_header_timeout_s=0.3)
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        status = await reader.readline()
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"GET /health HTTP/1.1\r\n")  # the next request, trickled
        closed = await _closed_by_server(reader)
        await server.stop()
        await f.schedulers.close()
        return status, closed

    status, closed = asyncio.run(main())
    assert status.startswith(b"HTTP/1.1 200") and closed


def test_a_request_whose_body_trickles_past_its_timeout_is_closed_and_one_sent_in_time_is_served():
    """A byte every 0.1 s resets no per-read timer: the whole body has one deadline from its head."""
    body = b'{"tokens": [104, 101, 108, 108, 111]}'
    head = (b"POST /detokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))

    async def main():
        f, server, host, port = await _serving(http_body_timeout_s=0.5, http_header_timeout_s=0.5)
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(head)
        started = asyncio.get_running_loop().time()
        sent = 0
        while not reader.at_eof() and sent < len(body):
            writer.write(body[sent:sent + 1])
            sent += 1
            try:
                await asyncio.wait_for(reader.read(), 0.1)  # b"" once the server closes
            except asyncio.TimeoutError:
                continue
        trickled = sent, asyncio.get_running_loop().time() - started
        # A body sent in time, in two parts, is served (and its connection kept): the timer is the
        # body's, not the connection's.
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(head + body[:10])
        await asyncio.sleep(0.3)
        writer.write(body[10:])
        status = await asyncio.wait_for(reader.readline(), HANG_S)
        await server.stop()
        await f.schedulers.close()
        return trickled, status

    (sent, took), status = asyncio.run(main())
    assert sent < len(body) and took < HANG_S  # cut off before the body could complete
    assert status.startswith(b"HTTP/1.1 200")


def test_a_peer_past_its_connection_cap_is_closed_at_once():
    async def main():
        f, server, host, port = await _serving(http_connections_per_peer=3)
        held = [await asyncio.open_connection(host, port) for _ in range(3)]
        reader, _ = await asyncio.open_connection(host, port)
        fourth_closed = await _closed_by_server(reader)
        writer = held[0][1]
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # the first three are served
        status = await held[0][0].readline()
        await server.stop()
        await f.schedulers.close()
        return fourth_closed, status

    fourth_closed, status = asyncio.run(main())
    assert fourth_closed and status.startswith(b"HTTP/1.1 200")


def test_past_the_connection_limit_the_api_is_503_but_health_answers():
    async def main():
        f, server, host, port = await _serving(http_connections_per_peer=0, limit=8)
        held = [await asyncio.open_connection(host, port) for _ in range(8)]
        for _, writer in held:  # requests under way (their bodies never come): they count
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
        while server.guard.in_progress < 8:
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient(base_url=f"http://{host}:{port}") as http:
            models = await http.get("/v1/models")
            health = await http.get("/health")
            for _, writer in held:
                writer.close()
            while server.guard.open > 1:  # the held ones are gone: only the client's own remains
                await asyncio.sleep(0.01)
            served = await http.get("/v1/models")
        await server.stop()
        await f.schedulers.close()
        return models, health, served

    models, health, served = asyncio.run(main())
    assert models.status_code == 503 and models.json()["error"]["type"] == "service_unavailable_error"
    assert "connection limit" in models.json()["error"]["message"]
    assert health.status_code == 200 and served.status_code == 200
