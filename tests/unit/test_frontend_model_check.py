"""A frontend whose tokenizer belongs to another model than its schedulers' refuses to start:
it would turn text into ids of another vocabulary and serve wrong answers, not errors."""
from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from tests.support.fake_scheduler import FakeScheduler
from tests.support.frontends import make_frontend
from vmesh.services.common.types import ModelLimits


def connect(model_name: str) -> None:
    async def main() -> None:
        async def no_detokenizer(frontend_id: str, address: str, dispatch: Callable,
                                 opened: Callable[[], None]) -> None:  # no detokenizers here
            opened()
            await asyncio.Event().wait()

        f = make_frontend(object(), scheduler=FakeScheduler(ModelLimits("SmolLM2-135M-Instruct", 100, 10)),
                          subscribe=no_detokenizer, model_name=model_name)
        try:
            await f.connect()
        finally:
            await f.close()

    asyncio.run(main())


def test_a_frontend_for_another_model_refuses_to_start():
    with pytest.raises(RuntimeError, match="give both the same --model"):
        connect("Qwen2-0.5B")


def test_a_frontend_for_the_same_model_starts():
    connect("SmolLM2-135M-Instruct")
