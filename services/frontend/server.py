"""The frontend's gRPC shell: the public API's RPCs translated onto the frontend's core (core.py),
and the process that serves them (and, beside them, the HTTP shell: http_server.py)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import grpc

from vmesh.services.common.grpc_server import ServiceShell
from vmesh.services.common.metrics import FrontendMetrics
from vmesh.services.common.runtime.readiness import Announcement, announce
from vmesh.services.common.server_settings import PublicPort, ServerSettings
from vmesh.services.common.wire.public import output_to_public, prompt_from_public, request_from_public
from vmesh.services.frontend import schedulers
from vmesh.services.frontend.core import FrontendCore
from vmesh.services.frontend.errors import RequestError
from vmesh.services.frontend.outbox import LostService
from vmesh.services.frontend.settings import FrontendServiceSettings
from vmesh.services.frontend.subscriptions import subscribe_over_grpc
from vmesh.v1 import common_pb2, frontend_pb2, frontend_pb2_grpc


class FrontendServicer(frontend_pb2_grpc.FrontendServiceServicer):
    """Generate, Tokenize, GetModelInfo and the LoRA loads over the core, their messages translated by
    wire/public.py; a RequestError becomes the call's status."""

    def __init__(self, core: FrontendCore):
        self.core = core

    async def _authorize(self, context) -> None:
        if self.core.settings.api_key:
            metadata = dict(context.invocation_metadata() or ())
            try:
                self.core.authorize(metadata.get("authorization"))
            except RequestError as exc:
                await context.abort(exc.code, exc.message)

    async def Generate(self, request, context):
        await self._authorize(context)
        try:
            metadata = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
            async for out in self.core.generate(request_from_public(request), context.time_remaining,
                                                trace_headers=metadata):
                yield output_to_public(out)
        except RequestError as exc:
            await context.abort(exc.code, exc.message)

    async def Tokenize(self, request, context):
        await self._authorize(context)
        try:
            return frontend_pb2.TokenizeResponse(token_ids=await self.core.encode(prompt_from_public(request)))
        except RequestError as exc:
            await context.abort(exc.code, exc.message)

    async def GetModelInfo(self, request, context):
        await self._authorize(context)
        try:
            limits = self.core.loaded_limits()
            return frontend_pb2.GetModelInfoResponse(model=limits.name, max_model_len=limits.max_model_len,
                                                     vocab_size=limits.vocab_size)
        except RequestError as exc:
            await context.abort(exc.code, exc.message)

    async def LoadLoraAdapter(self, request, context):
        await self._authorize(context)
        try:
            self._runtime_lora_updating()
            await self.core.adapters.load(request.lora_name, request.lora_path)
            return common_pb2.LoraAdapterResponse(lora_adapters=await self.core.adapters.refresh())
        except RequestError as exc:
            await context.abort(exc.code, exc.message)

    async def UnloadLoraAdapter(self, request, context):
        await self._authorize(context)
        try:
            self._runtime_lora_updating()
            await self.core.adapters.unload(request.lora_name)
            return common_pb2.LoraAdapterResponse(lora_adapters=await self.core.adapters.refresh())
        except RequestError as exc:
            await context.abort(exc.code, exc.message)

    def _runtime_lora_updating(self) -> None:
        """As the HTTP endpoints, which exist only with the flag."""
        if not self.core.settings.allow_runtime_lora_updating:
            raise RequestError(grpc.StatusCode.PERMISSION_DENIED,
                               "loading LoRA adapters at run time is off (vmesh serve --allow-runtime-lora-updating)")
        self.core.ready()


async def serve(settings: FrontendServiceSettings, load_tokenizer: Callable[[], Any], server: ServerSettings,
                public: PublicPort, locate_model: Callable[[], Path] | None = None) -> None:
    """With `settings.http_api_port`, also serve the OpenAI-compatible HTTP API there (0: any free
    port), on this event loop, over the same core; its address goes to `<ready_file>.http`.
    `server`: where the public gRPC port listens and this process's mutual-TLS identity toward
    the schedulers and detokenizers; `public`: the public ports' TLS and message cap; `locate_model`:
    the model directory, whose tokenizer.json and EOS ids the grammar compiler takes."""
    shell = ServiceShell("frontend", frontend_pb2.DESCRIPTOR.services_by_name["FrontendService"], server, public)
    registry = shell.metrics_registry()
    http_port = settings.http_api_port
    if registry is None and http_port is not None:  # the HTTP API serves /metrics itself
        from prometheus_client import CollectorRegistry

        registry = CollectorRegistry()
    # model_name is None only for embedders that skip the tokenizer check: an empty label is an absent one.
    metrics = FrontendMetrics(registry, settings.model_name or "", [kind.value for kind in LostService]) \
        if registry is not None else None
    core = FrontendCore(settings, metrics=metrics,
                        connect_scheduler=partial(schedulers.connect, identity=server.identity),
                        subscribe=partial(subscribe_over_grpc, identity=server.identity))
    frontend_pb2_grpc.add_FrontendServiceServicer_to_server(FrontendServicer(core), shell.server)
    http = None
    if http_port is not None:
        from vmesh.services.frontend.http_server import HttpServer

        # Listening before warm-up, as gRPC does: requests meanwhile get 503, not a refused connection.
        http = HttpServer(core, registry, server.host, http_port, public.tls_cert, public.tls_key)
        announce(server.ready_file, Announcement.HTTP, http.address)
        http.start()
    try:
        await shell.run(lambda: core.start(load_tokenizer, locate_model), core.drain)
    finally:
        if http is not None:
            await http.stop()
        await core.close()
