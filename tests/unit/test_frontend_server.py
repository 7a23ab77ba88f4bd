"""The frontend's detokenizer subscriptions as replicas join and leave, driven without a network."""
from __future__ import annotations

import asyncio
from collections.abc import Callable

from tests.support.frontends import make_frontend
from vmesh.services.frontend.outbox import Outbox


async def open_until_cancelled(frontend_id: str, address: str, dispatch: Callable, opened: Callable[[], None]) -> None:
    """A subscription that opens at once and stays open until cancelled."""
    opened()
    await asyncio.Event().wait()


def test_a_leaving_replica_keeps_its_subscription_until_its_last_request_ends():
    async def main() -> None:
        frontend = make_frontend(schedulers=("127.0.0.1:1",), detokenizers=("127.0.0.1:5",),
                                 subscribe=open_until_cancelled)
        await frontend.replicas.add("127.0.0.1:5").joined.wait()
        frontend.replicas.update(["127.0.0.1:6"], [])
        await asyncio.sleep(0)
        assert frontend.subscribed == {"127.0.0.1:5", "127.0.0.1:6"}

        outbox = Outbox(delta_text=True)
        key = frontend.register(outbox)
        outbox.detokenizer = "127.0.0.1:5"
        frontend.replicas.update([], ["127.0.0.1:5"])
        subscription = frontend.replicas.get("127.0.0.1:5").task
        assert not subscription.done()  # request 1 still streams from there
        assert frontend.listening() == ["127.0.0.1:6"]  # new requests go elsewhere

        frontend.unregister(key, outbox)  # it ended
        await asyncio.sleep(0)
        assert subscription.cancelled()
        assert "127.0.0.1:5" not in frontend.replicas and frontend.subscribed == {"127.0.0.1:6"}

        frontend.replicas.update(["127.0.0.1:5"], [])  # it came back
        await asyncio.sleep(0)
        assert frontend.subscribed == {"127.0.0.1:5", "127.0.0.1:6"}
        await frontend.close()

    asyncio.run(main())
