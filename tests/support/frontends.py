"""The frontend's core as the tests build it: the product's constructor over fake scheduler
groups and detokenizer subscriptions, no network."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tests.support.fake_scheduler import FakeScheduler
from tests.support.grpc_fakes import FakeChannel, healthy_forever, listening
from vmesh.services.common.types import ModelLimits
from vmesh.services.frontend.core import FrontendCore
from vmesh.services.frontend.settings import FrontendServiceSettings


def make_frontend(tokenizer: Any = None, limits: ModelLimits | None = None, *, scheduler: Any = None,
                  schedulers: tuple[str, ...] = ("s:1",), detokenizers: tuple[str, ...] = ("d:1",),
                  subscribe: Any = None, **settings: Any) -> FrontendCore:
    """A frontend core with these settings (FrontendSettings' fields, `model_name`). `scheduler`:
    the stub every scheduler group answers with, or one stub by address (their health never
    breaks); `subscribe`: how a detokenizer subscription opens (FrontendCore's)."""
    seams: dict[str, Any] = {}
    if scheduler is not None:
        def connect(address: str) -> tuple[Any, FakeChannel]:
            return scheduler[address] if isinstance(scheduler, Mapping) else scheduler, FakeChannel()

        seams.update(connect_scheduler=connect, scheduler_health=healthy_forever)
    if subscribe is not None:
        seams["subscribe"] = subscribe
    return FrontendCore(FrontendServiceSettings(scheduler_addresses=list(schedulers),
                                                detokenizer_addresses=list(detokenizers), **settings),
                        tokenizer=tokenizer, limits=limits, **seams)


async def serving_frontend(tokenizer: Any, scheduler: FakeScheduler | None = None,
                           listening_to: tuple[str, ...] = ("d:1",), **settings: Any,
                           ) -> tuple[FrontendCore, FakeScheduler]:
    """A frontend that has joined its scheduler group(s) (the model's limits are the scheduler's)
    and listens to these detokenizer replicas; and its scheduler."""
    scheduler = scheduler or FakeScheduler()
    f = make_frontend(tokenizer, scheduler=scheduler, **settings)
    await f.join_schedulers()
    listening(f, *listening_to)
    return f, scheduler


def openai_client(f: FrontendCore) -> Any:
    """The real `openai` client, talking to `f`'s HTTP app in process."""
    import httpx
    import openai

    from vmesh.services.frontend.http_server import build_app

    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(f, None)), base_url="http://frontend")
    return openai.AsyncOpenAI(base_url="http://frontend/v1", api_key="x", http_client=http, max_retries=0)


async def chat_completion(client: Any, body: dict[str, Any], stream: bool) -> Any:
    """One chat completion, whole or streamed (then assembled by the client)."""
    if not stream:
        return await client.chat.completions.create(**body)
    async with client.chat.completions.stream(**body) as events:
        return await events.get_final_completion()

