"""The interceptor every vmesh service installs: what arrives is checked before any servicer
sees it, whoever sent it.

- With mutual TLS, the caller's role (from its client certificate) must be one that may call
  the method (CALLERS): UNAUTHENTICATED without a role, PERMISSION_DENIED with the wrong one.
- Malformed requests (bytes that are not the method's message, strings that are not UTF-8)
  end with INVALID_ARGUMENT naming the method, not gRPC's generic UNKNOWN or INTERNAL."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from vmesh.services.common.tls import caller_role
from vmesh.services.common.types import ROLES

_ANY = frozenset(ROLES)
# Who may call what inside the mesh. A method not listed is refused to every caller.
CALLERS: dict[str, frozenset[str]] = {
    "/vmesh.v1.SchedulerService/SubmitRequest": frozenset({"frontend"}),
    "/vmesh.v1.SchedulerService/AbortRequest": frozenset({"frontend"}),
    "/vmesh.v1.SchedulerService/TakeOverRequest": frozenset({"frontend"}),
    "/vmesh.v1.SchedulerService/GetSchedulerStats": frozenset({"frontend", "admin"}),
    "/vmesh.v1.SchedulerService/ResetPrefixCache": frozenset({"admin"}),
    "/vmesh.v1.SchedulerService/WatchCache": frozenset({"frontend", "admin"}),
    "/vmesh.v1.SchedulerService/LoadLoraAdapter": frozenset({"frontend", "admin"}),
    "/vmesh.v1.SchedulerService/UnloadLoraAdapter": frozenset({"frontend", "admin"}),
    "/vmesh.v1.WorkerService/GetWorkerInfo": frozenset({"scheduler", "admin"}),
    "/vmesh.v1.WorkerService/Execute": frozenset({"scheduler"}),
    "/vmesh.v1.WorkerService/GetWorkerStats": frozenset({"scheduler", "admin"}),
    "/vmesh.v1.WorkerService/LoadLoraAdapter": frozenset({"scheduler", "admin"}),
    "/vmesh.v1.WorkerService/UnloadLoraAdapter": frozenset({"scheduler", "admin"}),
    "/vmesh.v1.DetokenizerService/Detokenize": frozenset({"scheduler"}),
    "/vmesh.v1.DetokenizerService/Subscribe": frozenset({"frontend"}),
    "/grpc.health.v1.Health/Check": _ANY,
    "/grpc.health.v1.Health/Watch": _ANY,
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": frozenset({"admin"}),
}


class _Malformed:
    """Stands in for a message that failed to parse, so the handler can refuse it properly."""

    def __init__(self, error: Exception):
        self.error = error


def _tolerant(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def tolerant_parse(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception as exc:  # protobuf's DecodeError, or invalid UTF-8 in a string field
            return _Malformed(exc)

    return tolerant_parse


async def _refuse(context: grpc.aio.ServicerContext, method: str) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: not a valid {method} message")


def _checked_stream(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext,
                    method: str) -> AsyncIterator[Any]:
    async def checked() -> AsyncIterator[Any]:
        async for request in requests:
            if isinstance(request, _Malformed):
                await _refuse(context, method)
            yield request

    return checked()


def _wrap(behavior: Callable[..., Any], streams_in: bool, method: str,
          allowed: frozenset[str] | None) -> Callable[..., Any]:
    """The same handler (a coroutine or an async generator) behind a check of its caller and
    its request(s). `allowed`: the roles that may call it; None when roles are not checked."""
    async def check(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if allowed is not None:
            role = caller_role(context)
            if role is None:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "a vmesh client certificate is required")
            if role not in allowed:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{role} may not call {method}")
        if streams_in:
            return _checked_stream(request, context, method)
        if isinstance(request, _Malformed):
            await _refuse(context, method)
        return request

    if inspect.isasyncgenfunction(behavior):
        async def stream_out(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            # aclosing: the handler's own clean-up (its `finally`) runs when the call ends, not
            # whenever the garbage collector gets to the generator.
            async with contextlib.aclosing(behavior(await check(request, context), context)) as responses:
                async for response in responses:
                    yield response

        return stream_out

    async def respond(request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await behavior(await check(request, context), context)

    return respond


class ServerGuard(grpc.aio.ServerInterceptor):
    def __init__(self, check_roles: bool):
        """`check_roles`: the server uses mutual TLS and enforces CALLERS."""
        self.check_roles = check_roles

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        allowed = CALLERS.get(method, frozenset()) if self.check_roles else None
        parse = _tolerant(handler.request_deserializer)
        serialize = handler.response_serializer
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(_wrap(handler.unary_unary, False, method, allowed), parse,
                                                       serialize)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(_wrap(handler.unary_stream, False, method, allowed), parse,
                                                        serialize)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(_wrap(handler.stream_unary, True, method, allowed), parse,
                                                        serialize)
        return grpc.stream_stream_rpc_method_handler(_wrap(handler.stream_stream, True, method, allowed), parse,
                                                     serialize)
