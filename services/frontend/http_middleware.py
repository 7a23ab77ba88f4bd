"""ASGI middleware ahead of the OpenAI routes: the API key and the body size are checked before a
request body is buffered or parsed on the frontend's one loop; OpenAI-shaped error responses and the handlers
that turn every failure into one."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from vmesh.services.frontend import openai_protocol as oai
from vmesh.services.frontend.auth import check_api_key
from vmesh.services.frontend.errors import RequestError

logger = logging.getLogger(__name__)

OPEN_PATHS = {"/health", "/metrics", "/openapi.json"}  # no API key asked: probes and scrapers


def body_limit(max_request_bytes: int) -> int:
    """The largest request body accepted: its prompts' budget plus room for the other fields (a
    request of token ids spends the budget on their digits)."""
    return max_request_bytes + 64 * 1024


def error_response(status: int, message: str, error_type: str, param: str | None = None,
           code: str | None = None) -> JSONResponse:
    return JSONResponse(oai.error_body(message, error_type, param, code), status_code=status)


def request_error_response(exc: RequestError, aliases: dict[str, str] | None = None) -> JSONResponse:
    status, body = oai.request_error_body(exc, aliases)
    return JSONResponse(body, status_code=status)


class ApiKeyMiddleware:
    """Bearer-key check ahead of everything else (body parsing included), so that a caller
    without the key learns nothing but 401. Plain ASGI: it must not buffer streamed responses."""

    def __init__(self, app: Any, api_key: str | None):
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and self.api_key and scope["path"] not in OPEN_PATHS:
            headers = dict(scope["headers"])
            authorization = headers.get(b"authorization", b"").decode("latin-1")
            try:
                check_api_key(self.api_key, authorization)
            except RequestError as exc:
                await request_error_response(exc)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Refuses a request body above `limit` bytes with 413 before it is buffered and parsed on
    the frontend's one loop: by its Content-Length at once, and by counting what arrives for a
    chunked upload (no Content-Length). Plain ASGI: it must not buffer streamed responses."""

    def __init__(self, app: Any, limit: int):
        self.app = app
        self.limit = limit

    def _too_large(self) -> JSONResponse:
        return error_response(413, f"request body: larger than {self.limit} bytes", "invalid_request_error")

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > self.limit:
            await self._too_large()(scope, receive, send)
            return
        received = 0
        started = False

        async def counted_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    # FastAPI re-raises an HTTPException raised while it reads the body, so the
                    # app's own handler answers 413; any other reader lets it reach the except below.
                    raise StarletteHTTPException(413, f"request body: larger than {self.limit} bytes")
            return message

        async def watched_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, watched_send)
        except StarletteHTTPException as exc:
            if exc.status_code != 413 or started:
                raise
            await self._too_large()(scope, receive, send)


def add_error_handlers(app: FastAPI) -> None:
    """Every failure as OpenAI's error body: refused requests, invalid bodies (`param` a JSON path),
    HTTP errors, and bugs (500, logged)."""
    @app.exception_handler(RequestError)
    async def on_request_error(_: Request, exc: RequestError) -> JSONResponse:
        return request_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        content_type = request.headers.get("content-type", "")
        if tuple(first.get("loc", ())) == ("body",) and content_type and "json" not in content_type.lower():
            # FastAPI reads a body as JSON when its type says so or it has none (`curl -d` sends a form)
            return error_response(400, f"body: send JSON with Content-Type: application/json "
                                       f"(got {content_type or 'no Content-Type'})", "invalid_request_error")
        if first.get("type") == "json_invalid":  # its location is a character offset, not a field
            where, why = first.get("loc", ("body", "?"))[-1], first.get("ctx", {}).get("error", "")
            return error_response(400, f"body: not valid JSON at character {where} ({why})", "invalid_request_error")
        param = oai.json_path(first.get("loc", ()))
        message = f"{param or 'body'}: {first.get('msg', 'invalid request body')}"
        return error_response(400, message, "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error" if exc.status_code < 500
                      else "internal_error")

    @app.exception_handler(Exception)
    async def on_bug(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("HTTP request failed")
        return error_response(500, f"internal error: {type(exc).__name__}", "internal_error")
