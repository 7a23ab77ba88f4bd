"""The OpenAI-compatible HTTP API at its limits, each on a mesh of its own: a full queue is a
429, a draining frontend a 503 on its health and its API, and HTTP can be turned off."""

from __future__ import annotations

import asyncio

import httpx

from tests.e2e.conftest import wait_idle
from vmesh.services.bench.mesh import start_mesh


def test_full_queue_is_429_and_a_draining_frontend_is_503():
    mesh = start_mesh("--max-waiting", "1", "--max-num-seqs", "1")
    try:
        async def main():
            async with httpx.AsyncClient(base_url=mesh.http_url, timeout=120) as http:
                body = {"prompt": "Tell me a story", "max_tokens": 300, "ignore_eos": True}
                calls = [asyncio.create_task(http.post("/completions", json=body)) for _ in range(4)]
                done, _ = await asyncio.wait(calls, return_when=asyncio.FIRST_COMPLETED)
                refused = [t.result() for t in done]
                for c in calls:
                    c.cancel()
                await asyncio.gather(*calls, return_exceptions=True)
                return refused

        refused = asyncio.run(main())
        assert {r.status_code for r in refused} == {429}
        assert refused[0].json()["error"]["type"] == "rate_limit_error"
        wait_idle(mesh)

        async def drain():
            async with httpx.AsyncClient(base_url=mesh.http_url.removesuffix("/v1"), timeout=120) as http:
                body = {"prompt": "Tell me a long story", "max_tokens": 2000, "ignore_eos": True, "stream": True}
                async with http.stream("POST", "/v1/completions", json=body) as streaming:
                    lines = streaming.aiter_lines()
                    while not (await lines.__anext__()).startswith("data: "):
                        pass
                    mesh.process.send_signal(15)  # the launcher stops the frontend first: it drains
                    while (health := await http.get("/health")).status_code == 200:
                        await asyncio.sleep(0.05)
                    refused = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
                    # Leaving now ends the drain (the gRPC tests check that a drain lets streams finish).
                return health, refused

        health, refused = asyncio.run(drain())
        assert health.status_code == 503 and "draining" in health.json()["error"]["message"]
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable_error"
    finally:
        mesh.stop()


def test_http_can_be_turned_off():
    mesh = start_mesh("--no-http")
    try:
        assert mesh.http_url == ""
    finally:
        mesh.stop()
