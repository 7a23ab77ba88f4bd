"""What every vmesh gRPC server shares: health and reflection, loopback-or-configured
binding, and an orderly shutdown on SIGTERM (health NOT_SERVING -> stop accepting -> drain
-> release)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from vmesh.services.common import tls
from vmesh.services.common.guards import ServerGuard
from vmesh.services.common.runtime.readiness import Announcement, announce

logger = logging.getLogger(__name__)

OVERALL = ""  # the health service's name for the whole server
# SERVING once warmed up, for as long as the process runs: a liveness probe's name. The overall
# status also says NOT_SERVING while the service cannot take work (a scheduler waiting for its
# lost worker, a drain), which must take it out of rotation, not get it killed.
LIVENESS = "liveness"
MAX_MESSAGE_BYTES = 64 << 20
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


@dataclass
class ShellOptions:
    """How this process's server listens, set once from the command line (services/cli.py)."""
    reflection: bool = False  # gRPC server reflection on internal ports (with mTLS, for the admin role only)
    health_port: int | None = None  # also serve Health alone, in plaintext, here (for probes that cannot do TLS)
    public_tls_cert: str | None = None  # the frontend's public port: TLS with this certificate...
    public_tls_key: str | None = None  # ...and key
    # What one client message may hold on the public port: prompts are capped far below the
    # internal 64 MiB, and a message is parsed (and copied) before any check can see it.
    public_max_message_bytes: int = 8 << 20


OPTIONS = ShellOptions()


class ServiceShell:
    def __init__(self, service: str, descriptor, host: str, port: int, public: bool = False):
        """`service`: the short name (worker, scheduler...); `descriptor`: its gRPC ServiceDescriptor.
        `public`: the port clients use (the frontend): TLS without client certificates when a
        public certificate is configured, the caller's role unchecked. Every other server uses
        mutual TLS and checks roles once this process has an identity (services/common/tls.py)."""
        from vmesh.services.common import telemetry

        telemetry.setup_tracing(service)
        if service == "frontend":  # the only service that records GenAI metrics
            telemetry.setup_metrics(service)
        self.host = host
        identity = tls.current()
        check_roles = identity is not None and not public
        options = SERVER_OPTIONS
        if public:
            options = [*(o for o in SERVER_OPTIONS if o[0] != "grpc.max_receive_message_length"),
                       ("grpc.max_receive_message_length", OPTIONS.public_max_message_bytes)]
        self.server = grpc.aio.server(options=options, interceptors=[ServerGuard(check_roles)])
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = [descriptor.full_name]
        if OPTIONS.reflection and not public:  # the public port describes only its own contract
            reflection.enable_server_reflection([*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME],
                                                self.server)
        self.port = self._bind(self.server, f"{host}:{port}", public, identity)
        self.address = f"{host}:{self.port}"
        self.health_server: grpc.aio.Server | None = None
        self.health_address = ""
        if OPTIONS.health_port is not None:
            self.health_server = grpc.aio.server(options=SERVER_OPTIONS)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            health_port = self._bind(self.health_server, f"{host}:{OPTIONS.health_port}", False, None)
            self.health_address = f"{host}:{health_port}"
        self.stopping = asyncio.Event()

    @staticmethod
    def _bind(server: grpc.aio.Server, address: str, public: bool, identity: tls.Identity | None) -> int:
        try:
            if public and OPTIONS.public_tls_cert:
                if not OPTIONS.public_tls_key:
                    raise ValueError("--public-tls-cert needs --public-tls-key")
                port = server.add_secure_port(address, tls.public_server_credentials(OPTIONS.public_tls_cert,
                                                                                     OPTIONS.public_tls_key))
            elif not public and identity is not None:
                port = server.add_secure_port(address, tls.server_credentials(identity))
            else:
                port = server.add_insecure_port(address)
        except RuntimeError as exc:  # newer gRPC raises where older returned 0
            raise OSError(f"cannot bind {address}: {exc}") from exc
        if port == 0:
            raise OSError(f"cannot bind {address}")
        return port

    def metrics_registry(self, metrics_port: int | None, ready_file: str | None):
        """A Prometheus registry served on `metrics_port`, or None when metrics are off."""
        if metrics_port is None:
            return None
        from prometheus_client import CollectorRegistry

        from vmesh.services.common.metrics import serve_metrics

        registry = CollectorRegistry()
        serve_metrics(registry, self.host, metrics_port, ready_file)
        return registry

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in [OVERALL, *self.service_names]:
            await self.health.set(name, status)

    async def run(self, warm_up: Callable[[], Awaitable[None]], drain: Callable[[], Awaitable[None]],
                  ready_file: str | None = None, grace_seconds: float = 30.0) -> None:
        """Start NOT_SERVING, warm up, serve until SIGTERM/SIGINT, then drain and stop."""
        await self.set_serving(False)
        await self.server.start()
        if self.health_server is not None:
            await self.health_server.start()
            announce(ready_file, Announcement.HEALTH, self.health_address)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        announce(ready_file, Announcement.ADDRESS, self.address)  # a launcher that asked for port 0 learns it
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
        await self.server.stop(grace=1.0)
        if self.health_server is not None:
            await self.health_server.stop(None)
        from vmesh.services.common import telemetry

        telemetry.shutdown_tracing()


def channel(address: str, peer: str | None = None, secure: bool = True,
            identity: tls.Identity | None = None) -> grpc.aio.Channel:
    """A channel to another vmesh service. `peer`: the role expected there (scheduler, worker,
    detokenizer...); once this process has an identity (or one is given) the channel uses mutual
    TLS and accepts only a certificate issued for that role. `secure=False`: plaintext whatever
    the identity (a plaintext health port)."""
    identity = identity or tls.current()
    if identity is None or not secure:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    if peer is None:
        raise ValueError(f"a mutual-TLS channel to {address} needs the peer's role")
    credentials, options = tls.channel_security(identity, peer)
    return grpc.aio.secure_channel(address, credentials, options=[*CHANNEL_OPTIONS, *options])


async def wait_until_serving(address: str, timeout: float, peer: str | None = None, secure: bool = True) -> None:
    """Block until `address` reports SERVING; raise TimeoutError otherwise. Each check is also
    bounded on the event loop's clock, so the deadline holds even if gRPC never answers."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    async with channel(address, peer, secure) as ch:
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
