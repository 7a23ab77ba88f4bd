"""The frontend: the public API's gRPC shell, and the state every request shares: the scheduler
groups it submits to, and one subscription per detokenizer replica, over which every
request's outputs arrive. The request path itself is requests.py; the HTTP shell is
http_server.py."""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from vmesh.services.common.grpc_server import channel, frontend_adapter
from vmesh.services.common.metrics import FrontendMetrics
from vmesh.services.common.runtime.discovery import DEFAULT_REFRESH_INTERVAL_S, AddressBook
from vmesh.services.common.runtime.peers import Peer, PeerSet
from vmesh.services.common.runtime.readiness import Announcement, announce
from vmesh.services.common.runtime.retry import Backoff
from vmesh.services.common.runtime.stream import KeptStream
from vmesh.services.common.runtime.tasks import TaskGroup, wait_until
from vmesh.services.common.types import ModelLimits, OutputBatch
from vmesh.services.common.wire import outputs
from vmesh.services.frontend import requests
from vmesh.services.frontend.errors import RequestError
from vmesh.services.frontend.outbox import LostService, Outbox, PendingOutput
from vmesh.services.frontend.schedulers import SchedulerPool
from vmesh.services.frontend.settings import DEFAULT_FAILOVER_TIMEOUT_S, DEFAULT_MAX_PROMPT_BYTES
from vmesh.v1 import detokenizer_pb2, detokenizer_pb2_grpc, frontend_pb2, frontend_pb2_grpc

logger = logging.getLogger(__name__)

RESUBSCRIBE = Backoff(1.0)


@dataclass
class Subscription(Peer):
    """This frontend's subscription to one detokenizer replica, kept open (reopened after a
    break) by its task for as long as the replica is listed or still serves a request.
    `alive`: the subscription is open now; `joined`: it opened once (or the replica left)."""


class FrontendServicer(frontend_pb2_grpc.FrontendServiceServicer):
    def __init__(self, tokenizer, scheduler_specs: list[str], detokenizer_specs: list[str],
                 replica_refresh_interval_s: float = DEFAULT_REFRESH_INTERVAL_S, api_key: str | None = None,
                 max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES, model_name: str | None = None,
                 failover_timeout_s: float = DEFAULT_FAILOVER_TIMEOUT_S, routing: str = "prefix",
                 resubscribe: Backoff = RESUBSCRIBE):
        """Specs: host:port or dns:///name:port entries, re-resolved periodically. Several
        schedulers are several worker groups (data parallelism). `api_key`: required of
        Generate, Tokenize and GetModelInfo callers as `authorization: Bearer KEY` metadata.
        `resubscribe`: the wait before subscribing again to a replica whose subscription broke."""
        self.tokenizer = tokenizer
        self.model_name = model_name  # the model whose tokenizer it loaded (None: not checked)
        self.api_key = api_key
        self.max_prompt_bytes = max_prompt_bytes
        self.failover_timeout_s = failover_timeout_s
        self.draining = False
        self.background = TaskGroup()  # aborts that outlive their request
        self.frontend_id = f"frontend-{uuid.uuid4().hex[:12]}"
        self.scheduler_addresses = AddressBook(scheduler_specs)
        self.schedulers = SchedulerPool(on_lost=self._scheduler_lost, routing=routing)
        self.detokenizers = AddressBook(detokenizer_specs)
        self.replica_refresh_interval_s = replica_refresh_interval_s
        self.outboxes: dict[int, Outbox] = {}  # by frontend key
        self.frontend_keys = itertools.count(1)
        self.limits: ModelLimits | None = None
        self.resubscribe = resubscribe
        self.replicas: PeerSet[Subscription] = PeerSet(
            "detokenizer", self._start_subscription, is_idle=self._serves_nothing, stop=Subscription.stop,
            on_retire=lambda subscription: subscription.joined.set())  # start-up stops waiting for it
        self._tasks = TaskGroup()
        self.in_flight = 0
        self.metrics: FrontendMetrics | None = None

    async def connect(self) -> None:
        groups = [self.schedulers.add(address) for address in self.scheduler_addresses.addresses]
        await asyncio.gather(*(g.joined.wait() for g in groups))
        if not self.schedulers.candidates():
            raise RuntimeError("no scheduler answered")
        limits = self.schedulers.limits
        if limits is None:
            raise RuntimeError("no scheduler told its model")
        if self.model_name is not None and limits.name != self.model_name:
            # Its tokenizer would turn text into ids of another vocabulary: wrong answers, not errors.
            raise RuntimeError(f"this frontend loaded the tokenizer of {self.model_name!r}, but the schedulers "
                               f"serve {limits.name!r}; give both the same --model")
        self.limits = limits
        await asyncio.gather(*(self.replicas.add(address).joined.wait() for address in self.detokenizers.addresses))
        self._tasks.spawn(self.replicas.follow(self.detokenizers, self.replica_refresh_interval_s))
        self._tasks.spawn(self.schedulers.members.follow(self.scheduler_addresses, self.replica_refresh_interval_s))

    async def close(self) -> None:
        self._tasks.cancel()
        for subscription in self.replicas:
            subscription.stop()
        await self.schedulers.close()

    # --- subscriptions -----------------------------------------------------------------------

    @property
    def subscribed(self) -> set[str]:
        """Replicas whose subscription is open right now."""
        return {subscription.address for subscription in self.replicas if subscription.alive}

    def listening(self) -> list[str]:
        """Replicas a new request may be routed to: subscribed, and not leaving."""
        return sorted(subscription.address for subscription in self.replicas if subscription.routable)

    def release_if_idle(self, address: str) -> None:
        """A request served by `address` ended: a leaving replica may now be let go."""
        if (subscription := self.replicas.get(address)) is not None:
            self.replicas.release_if_idle(subscription)

    def _start_subscription(self, address: str) -> Subscription:
        subscription = Subscription(address)

        async def broke(exc: Exception) -> bool:
            subscription.alive = False
            logger.error("detokenizer %s unavailable: %s", address, exc)
            self._fail_replica(address, "the detokenizer serving this request became unavailable")
            return True  # subscribed again until the replica is let go

        stream = KeptStream(subscription, lambda opened: self._subscribe(address, opened), broke, self.resubscribe)
        subscription.task = asyncio.create_task(stream.run())
        return subscription

    def _serves_nothing(self, subscription: Subscription) -> bool:
        return all(o.detokenizer != subscription.address for o in self.outboxes.values())

    async def _subscribe(self, address: str, opened: Callable[[], None]) -> None:
        """One subscription to a replica, read until it breaks (its requests then fail over)."""
        async with channel(address, "detokenizer") as ch:
            stub = detokenizer_pb2_grpc.DetokenizerServiceStub(ch)
            call = stub.Subscribe(detokenizer_pb2.SubscribeRequest(frontend_id=self.frontend_id), wait_for_ready=True)
            # The replica sends metadata once it has registered us.
            await call.initial_metadata()
            opened()
            async for batch in call:
                self._dispatch(outputs.from_proto(batch))
            raise ConnectionError("subscription closed")

    def _dispatch(self, batch: OutputBatch) -> None:
        for output in batch.outputs:
            outbox = self.outboxes.get(output.frontend_key)
            if outbox is None:
                continue
            if output.error:  # it ends the request (or its path, for a failover): no finish reason, no usage
                outbox.put(PendingOutput(text=output.text, token_ids=output.token_ids, logprobs=output.logprobs,
                                         error=output.error, lost=LostService.SCHEDULER if output.resumable else None))
                continue
            out = PendingOutput(text=output.text, token_ids=output.token_ids, logprobs=output.logprobs,
                                finish_reason=output.finish_reason)
            if out.finished:
                out.usage = output.usage
            outbox.put(out)

    def _scheduler_lost(self, group) -> None:
        """The group's requests, queued ones included, fail over (their detokenizer may never
        have heard of them, so nothing else would move them)."""
        for outbox in self.outboxes.values():
            if outbox.group is group:
                outbox.put(PendingOutput(error="the scheduler serving this request went away",
                                         lost=LostService.SCHEDULER))

    def _fail_replica(self, address: str, message: str) -> None:
        """The replica's requests fail over to another one (or to it, restarted)."""
        for outbox in self.outboxes.values():
            if outbox.detokenizer == address:
                outbox.put(PendingOutput(error=message, lost=LostService.DETOKENIZER))

    # --- RPCs: the gRPC shell over the shared request path (requests.py) --------------------

    async def _authorize(self, context) -> None:
        if self.api_key:
            metadata = dict(context.invocation_metadata() or ())
            try:
                requests.check_api_key(self.api_key, metadata.get("authorization"))
            except RequestError as exc:
                await context.abort(exc.code, exc.message)

    async def Generate(self, request, context):
        await self._authorize(context)
        try:
            metadata = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
            async for response in requests.generate(self, request, context.time_remaining, trace_headers=metadata):
                yield response
        except RequestError as exc:
            await context.abort(exc.code, exc.message)

    async def Tokenize(self, request, context):
        await self._authorize(context)
        try:
            return frontend_pb2.TokenizeResponse(token_ids=await requests.encode(self, request))
        except RequestError as exc:
            await context.abort(exc.code, exc.message)

    async def GetModelInfo(self, request, context):
        await self._authorize(context)
        try:
            return requests.model_info(self)
        except RequestError as exc:
            await context.abort(exc.code, exc.message)

    def serving(self) -> bool:
        """Started, not draining, and at least one scheduler group and detokenizer to use."""
        return (self.tokenizer is not None and self.limits is not None and not self.draining
                and bool(self.schedulers.candidates()) and bool(self.listening()))

    async def drain(self) -> None:
        self.draining = True  # new requests are refused from here on; those in flight finish
        await wait_until(lambda: not self.in_flight)


async def serve(load_tokenizer, scheduler_specs: list[str], detokenizer_specs: list[str], host: str, port: int,
                ready_file: str | None, metrics_port: int | None = None,
                replica_refresh_interval_s: float = DEFAULT_REFRESH_INTERVAL_S, http_port: int | None = None,
                api_key: str | None = None, max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES,
                model_name: str | None = None, failover_timeout_s: float = DEFAULT_FAILOVER_TIMEOUT_S,
                routing: str = "prefix") -> None:
    """`http_port`: also serve the OpenAI-compatible HTTP API there (0: any free port; None: off),
    on this event loop, over the same request path; its address goes to `<ready_file>.http`."""
    shell = frontend_adapter.shell(frontend_pb2.DESCRIPTOR.services_by_name["FrontendService"], host, port,
                                   ready_file, metrics_port)
    servicer = FrontendServicer(None, scheduler_specs, detokenizer_specs, replica_refresh_interval_s, api_key,
                                max_prompt_bytes, model_name, failover_timeout_s, routing)
    frontend_pb2_grpc.add_FrontendServiceServicer_to_server(servicer, shell.server)
    registry = shell.metrics_registry()
    if registry is None and http_port is not None:  # the HTTP API serves /metrics itself
        from prometheus_client import CollectorRegistry

        registry = CollectorRegistry()
    if registry is not None:
        # model_name is None only for embedders that skip the tokenizer check: an empty label is an absent one.
        servicer.metrics = FrontendMetrics(registry, model_name or "")
    http = None
    if http_port is not None:
        from vmesh.services.frontend.http_server import HttpServer

        # Listening before warm-up, as gRPC does: requests meanwhile get 503, not a refused connection.
        http = HttpServer(servicer, registry, host, http_port)
        announce(ready_file, Announcement.HTTP, http.address)
        http.start()

    async def warm_up() -> None:
        servicer.tokenizer = await asyncio.get_running_loop().run_in_executor(None, load_tokenizer)
        await servicer.connect()

    try:
        await shell.run(warm_up, servicer.drain)
    finally:
        if http is not None:
            await http.stop()
        await servicer.close()
