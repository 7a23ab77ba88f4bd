"""The frontend's detokenizer subscriptions as replicas join and leave, driven without a network."""
from __future__ import annotations

import asyncio
from collections.abc import Callable

from vmesh.services.frontend.outbox import Outbox
from vmesh.services.frontend.server import FrontendServicer


class Frontend(FrontendServicer):
    """Subscriptions that open at once and stay open until cancelled."""

    async def _subscribe(self, address: str, opened: Callable[[], None]) -> None:
        opened()
        await asyncio.Event().wait()


def test_a_leaving_replica_keeps_its_subscription_until_its_last_request_ends():
    async def main() -> None:
        frontend = Frontend(None, ["127.0.0.1:1"], ["127.0.0.1:5"])
        await frontend.replicas.add("127.0.0.1:5").joined.wait()
        frontend.replicas.update(["127.0.0.1:6"], [])
        await asyncio.sleep(0)
        assert frontend.subscribed == {"127.0.0.1:5", "127.0.0.1:6"}

        outbox = frontend.outboxes[1] = Outbox(delta_text=True)
        outbox.detokenizer = "127.0.0.1:5"
        frontend.replicas.update([], ["127.0.0.1:5"])
        subscription = frontend.replicas.get("127.0.0.1:5").task
        assert not subscription.done()  # request 1 still streams from there
        assert frontend.listening() == ["127.0.0.1:6"]  # new requests go elsewhere

        del frontend.outboxes[1]
        frontend.release_if_idle("127.0.0.1:5")
        await asyncio.sleep(0)
        assert subscription.cancelled()
        assert "127.0.0.1:5" not in frontend.replicas and frontend.subscribed == {"127.0.0.1:6"}

        frontend.replicas.update(["127.0.0.1:5"], [])  # it came back
        await asyncio.sleep(0)
        assert frontend.subscribed == {"127.0.0.1:5", "127.0.0.1:6"}
        await frontend.close()

    asyncio.run(main())
