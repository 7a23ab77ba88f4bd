"""Streamed events carry SSE ids only for a client that asked (`Vmesh-Resumable: 1`) or is
resuming: a plain stream is `data:` lines alone, which SSE readers that take each event for its
data line (vLLM's benchmark client splits on blank lines and parses what follows "data: ") read."""
from __future__ import annotations

import asyncio
import json

import pytest

from tests.support.frontends import serving_frontend
from tests.unit.test_openai_http import LENGTH, Call, CharTokenizer, emit
from vmesh.services.common.resume import points_from_event_id
from vmesh.services.frontend.http_server import build_app


def _stream(headers: dict[str, str]) -> str:
    async def main() -> str:
        f, scheduler = await serving_frontend(CharTokenizer())
        call = Call(build_app(f, None), "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True,
                     "stream_options": {"include_usage": True}}, headers=headers)
        await scheduler.until_submitted(1)
        emit(f, "a")
        emit(f, "b", LENGTH)
        await call.task
        return call.body

    return asyncio.run(main())


def _as_vllms_client_reads(body: str) -> list[dict]:
    """vLLM's benchmark client: messages split on blank lines, "data: " removed, JSON parsed."""
    messages = [m.strip() for m in body.split("\n\n") if m.strip()]
    return [json.loads(m.removeprefix("data: ")) for m in messages if m.removeprefix("data: ") != "[DONE]"]


def test_a_plain_stream_is_data_lines_alone():
    body = _stream({})
    assert "id:" not in body
    chunks = _as_vllms_client_reads(body)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "ab"


@pytest.mark.parametrize("value", ["1", "true"])
def test_a_resumable_stream_carries_each_choices_progress(value: str):
    body = _stream({"Vmesh-Resumable": value})
    ids = [line.removeprefix("id: ") for line in body.splitlines() if line.startswith("id: ")]
    assert ids, body
    [point] = points_from_event_id(ids[-1])
    assert (point.num_output_tokens, point.text_length, point.finished) == (2, 2, True)
    with pytest.raises(json.JSONDecodeError):  # what such a reader makes of an event with an id
        _as_vllms_client_reads(body)
