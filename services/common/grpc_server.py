"""What every vmesh gRPC server shares: health and reflection, loopback-or-configured
binding, and an orderly shutdown on SIGTERM (health NOT_SERVING -> stop accepting -> drain
-> release)."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from vmesh.services.common import telemetry, tls
from vmesh.services.common.guards import ServerGuard
from vmesh.services.common.metrics import serve_metrics
from vmesh.services.common.runtime.readiness import Announcement, announce
from vmesh.services.common.server_settings import PublicPort, ServerSettings

logger = logging.getLogger(__name__)

OVERALL = ""  # the health service's name for the whole server
# SERVING once warmed up, for as long as the process runs: a liveness probe's name. The overall
# status also says NOT_SERVING while the service cannot take work (a scheduler waiting for its
# lost worker, a drain), which must take it out of rotation, not get it killed.
LIVENESS = "liveness"
MAX_MESSAGE_BYTES = 64 << 20
# After SIGTERM: how long requests in flight may take to finish, then how long calls still open get
# before the server ends them itself (with a status, not a cut connection).
DRAIN_GRACE_S = 30.0
STOP_GRACE_S = 1.0
_MESSAGE_LIMITS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
# Long-lived internal streams detect a dead peer by keepalive pings...
CHANNEL_OPTIONS = [*_MESSAGE_LIMITS, ("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000),
                   ("grpc.http2.max_pings_without_data", 0), ("grpc.keepalive_permit_without_calls", 1),
                   # A restarted peer is found within 2 s; gRPC's default backoff grows to 120 s.
                   ("grpc.initial_reconnect_backoff_ms", 250), ("grpc.min_reconnect_backoff_ms", 250),
                   ("grpc.max_reconnect_backoff_ms", 2_000)]
# ...which servers must accept, or they close the connection after a few ("too many pings").
# SO_REUSEPORT (gRPC's default) is off: with it, a second server on a taken port binds too and
# the kernel splits connections between the two.
SERVER_OPTIONS = [*_MESSAGE_LIMITS, ("grpc.so_reuseport", 0),
                  ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
                  ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_ping_strikes", 0)]


class ServiceShell:
    def __init__(self, service: str, descriptor, settings: ServerSettings, public: PublicPort | None = None):
        """`service`: the short name (worker, scheduler...); `descriptor`: its gRPC ServiceDescriptor;
        `settings`: where and how it listens, and this process's identity. `public`: this is the
        port clients use (the frontend's): TLS without client certificates when it has a
        certificate, the caller's role unchecked. Every other server uses mutual TLS and checks
        roles when the process has an identity (services/common/tls.py)."""
        telemetry.setup_tracing(service)
        if service == "frontend":  # the only service that records GenAI metrics
            telemetry.setup_metrics(service)
        self.settings = settings
        self.host = settings.host
        check_roles = settings.identity is not None and public is None
        options = SERVER_OPTIONS
        if public is not None:
            options = [*(o for o in SERVER_OPTIONS if o[0] != "grpc.max_receive_message_length"),
                       ("grpc.max_receive_message_length", public.max_message_bytes)]
        self.server = grpc.aio.server(options=options, interceptors=[ServerGuard(check_roles)])
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = [descriptor.full_name]
        if settings.reflection and public is None:  # the public port describes only its own contract
            reflection.enable_server_reflection([*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME],
                                                self.server)
        self.port = self._bind(self.server, f"{self.host}:{settings.port}", self._credentials(public))
        self.address = f"{self.host}:{self.port}"
        self.health_server: grpc.aio.Server | None = None
        self.health_address = ""
        if settings.health_port is not None:
            self.health_server = grpc.aio.server(options=SERVER_OPTIONS)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            health_port = self._bind(self.health_server, f"{self.host}:{settings.health_port}", None)
            self.health_address = f"{self.host}:{health_port}"
        self.stopping = asyncio.Event()

    def _credentials(self, public: PublicPort | None) -> grpc.ServerCredentials | None:
        """The main port's credentials; None: plaintext."""
        if public is not None:
            if public.tls_cert is None or public.tls_key is None:  # both or neither (PublicPort)
                return None
            return tls.public_server_credentials(public.tls_cert, public.tls_key)
        identity = self.settings.identity
        return tls.server_credentials(identity) if identity is not None else None

    @staticmethod
    def _bind(server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None) -> int:
        try:
            if credentials is not None:
                port = server.add_secure_port(address, credentials)
            else:
                port = server.add_insecure_port(address)
        except RuntimeError as exc:  # newer gRPC raises where older returned 0
            raise OSError(f"cannot bind {address}: {exc}") from exc
        if port == 0:
            raise OSError(f"cannot bind {address}")
        return port

    def metrics_registry(self) -> CollectorRegistry | None:
        """A Prometheus registry served on the settings' metrics port, or None when metrics are off."""
        if self.settings.metrics_port is None:
            return None
        registry = CollectorRegistry()
        serve_metrics(registry, self.host, self.settings.metrics_port, self.settings.ready_file)
        return registry

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in [OVERALL, *self.service_names]:
            await self.health.set(name, status)

    async def run(self, warm_up: Callable[[], Awaitable[None]], drain: Callable[[], Awaitable[None]],
                  grace_seconds: float = DRAIN_GRACE_S) -> None:
        """Start NOT_SERVING, warm up, serve until SIGTERM/SIGINT, then drain and stop. The
        addresses it binds go to the settings' ready file, for a launcher that asked for port 0."""
        ready_file = self.settings.ready_file
        await self.set_serving(False)
        await self.server.start()
        if self.health_server is not None:
            await self.health_server.start()
            announce(ready_file, Announcement.HEALTH, self.health_address)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            # An ignored SIGINT stays ignored (a service of `vmesh serve`, or a shell's background job).
            if sig != signal.SIGINT or signal.getsignal(sig) is not signal.SIG_IGN:
                loop.add_signal_handler(sig, self.stopping.set)
        announce(ready_file, Announcement.ADDRESS, self.address)
        warming = asyncio.ensure_future(warm_up())
        stopped = asyncio.ensure_future(self.stopping.wait())
        await asyncio.wait({warming, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not warming.done():
            # Stopped while warming up (the launcher died or gave up): nothing to drain, and a
            # model load in a thread cannot be cancelled; leave at once rather than linger.
            logger.warning("stopped during warm-up; exiting")
            os._exit(0)
        stopped.cancel()
        warming.result()
        freeze_startup_heap()
        await self.health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
        await self.set_serving(True)
        logger.info("serving %s on %s", ", ".join(self.service_names), self.address)
        await self.stopping.wait()
        logger.info("draining")
        await self.set_serving(False)
        try:
            await asyncio.wait_for(drain(), grace_seconds)
        except asyncio.TimeoutError:
            logger.warning("drain did not finish within %.0f s", grace_seconds)
        await self.server.stop(grace=STOP_GRACE_S)
        if self.health_server is not None:
            await self.health_server.stop(None)
        telemetry.shutdown_tracing()


def freeze_startup_heap() -> None:
    """Exempt everything a service built while starting (imported modules, a tokenizer, a model's
    Python objects) from the collector's full passes. Those objects live as long as the process, and
    a full pass over them stalls the service's event loop for as long as it takes: measured 0.24-0.36
    s in a frontend's loop when 5,000 connections arrived at once, every other client waiting.
    The cost: a reference cycle among objects alive at this moment (a connection already open as
    the service starts) is never collected; it is bounded by what is alive here, once."""
    gc.collect()
    gc.freeze()
    logger.debug("%d objects exempt from garbage collection", gc.get_freeze_count())


def channel(address: str, peer: str | None = None, secure: bool = True,
            identity: tls.Identity | None = None) -> grpc.aio.Channel:
    """A channel to another vmesh service. `peer`: the role expected there (scheduler, worker,
    detokenizer...); with an `identity` (the caller's ServerSettings.identity) the channel uses
    mutual TLS and accepts only a certificate issued for that role. `secure=False`: plaintext
    whatever the identity (a plaintext health port)."""
    if identity is None or not secure:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    if peer is None:
        raise ValueError(f"a mutual-TLS channel to {address} needs the peer's role")
    credentials, options = tls.channel_security(identity, peer)
    return grpc.aio.secure_channel(address, credentials, options=[*CHANNEL_OPTIONS, *options])


async def wait_until_serving(address: str, timeout: float, peer: str | None = None, secure: bool = True,
                             identity: tls.Identity | None = None) -> None:
    """Block until `address` reports SERVING; raise TimeoutError otherwise. Each check is also
    bounded on the event loop's clock, so the deadline holds even if gRPC never answers.
    `identity`: the caller's, for a service that requires mutual TLS."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    async with channel(address, peer, secure, identity) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            attempt = min(2.0, max(0.1, deadline - loop.time()))
            try:
                reply = await asyncio.wait_for(
                    stub.Check(health_pb2.HealthCheckRequest(service=OVERALL), timeout=attempt), attempt + 0.5)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except (grpc.aio.AioRpcError, asyncio.TimeoutError):
                pass
            if loop.time() > deadline:
                raise TimeoutError(f"{address} did not become healthy within {timeout:.0f} s")
            await asyncio.sleep(0.2)
