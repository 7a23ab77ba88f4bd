"""The frontend's HTTP shell: OpenAI's API (/v1/models, /v1/completions, /v1/chat/completions, /v1/responses,
streamed as Server-Sent Events; /v1/embeddings in embeddings_api.py), vLLM's utility endpoints (utility_api.py),
/health, /metrics and /openapi.json, served by uvicorn on the frontend's own event loop over the same core as
gRPC (core.py). A client that disconnects aborts its requests, as a cancelled gRPC stream does."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from vmesh.services.common.generation import GenerationRequest
from vmesh.services.common.types import Usage
from vmesh.services.frontend import embeddings_api, http_resume, responses_api, responses_events, utility_api
from vmesh.services.frontend import openai_protocol as oai
from vmesh.services.frontend import openai_responses as render
from vmesh.services.frontend.core import FrontendCore
from vmesh.services.frontend.errors import RequestError, refused_as_request_errors
from vmesh.services.frontend.fanout import ClientGone, Fanout, FanoutStreamingResponse, until_disconnect
from vmesh.services.frontend.http_connections import (
    ConnectionGuard,
    ConnectionLimitMiddleware,
    GuardedServer,
    bind,
    guarded_config,
)
from vmesh.services.frontend.http_middleware import (
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    add_error_handlers,
    body_limit,
    error_response,
    request_error_response,
)
from vmesh.services.frontend.http_reply import Chunk, Reply, sse
from vmesh.services.frontend.inputs import check_request_budget, check_request_tokens
from vmesh.services.frontend.lora_http import adapter_cards, add_lora_routes
from vmesh.services.frontend.tool_calls import ToolPlan
from vmesh.services.frontend.tool_parsers import ContentDelta, Delta, ToolCallParser, ToolReader, make_parser

if TYPE_CHECKING:  # a type only: /metrics imports prometheus_client when scraped
    from prometheus_client import CollectorRegistry

logger = logging.getLogger(__name__)

# Connections plus requests in progress before uvicorn answers 503: every open connection holds
# memory and a task on the frontend's one loop, so a flood of them must stop somewhere.
LIMIT_CONCURRENCY = 4096
KEEP_ALIVE_S = 15  # an idle keep-alive connection is closed after this long


def tool_call_delta(delta: Delta, legacy: bool = False) -> dict[str, Any]:
    """One parser delta as OpenAI's chunk `delta`: a call's first chunk carries its id, type and
    name (and arguments ""), later ones its index and a fragment of its arguments. `legacy`: the
    legacy `functions`' one `function_call`, its name first, then its arguments' fragments."""
    if isinstance(delta, ContentDelta):
        return {"content": delta.text}
    if legacy:
        return {"function_call": {"name": delta.name, "arguments": delta.arguments} if delta.id is not None
                else {"arguments": delta.arguments}}
    if delta.id is not None:
        return {"tool_calls": [{"index": delta.index, "id": delta.id, "type": "function",
                                "function": {"name": delta.name, "arguments": delta.arguments}}]}
    return {"tool_calls": [{"index": delta.index, "function": {"arguments": delta.arguments}}]}


def _tool_deltas(parser: ToolCallParser, text: str, finished: bool, want_one: bool, legacy: bool
                 ) -> list[dict[str, Any]]:
    """The chunk deltas one output makes through `parser` (`finished`: its last, so the parser
    lets go of what it holds); `want_one`: at least one delta, to carry the output's logprobs."""
    deltas = [tool_call_delta(d, legacy) for d in [*parser.feed(text), *(parser.finish() if finished else ())]]
    return deltas or ([{}] if want_one else [])


class OpenAIRoutes:
    def __init__(self, frontend: FrontendCore):
        self.frontend = frontend
        self.created = int(time.time())
        self._tokens: render.TokenTable | None = None

    def served(self) -> str:
        self.frontend.ready()
        return self.frontend.loaded_limits().name

    @property
    def tokens(self) -> render.TokenTable:
        """The token table of the tokenizer now loaded (one per tokenizer: ids mean nothing
        across tokenizers)."""
        if self._tokens is None or self._tokens.tokenizer is not self.frontend.tokenizer:
            self._tokens = render.TokenTable(self.frontend.tokenizer)
        return self._tokens

    async def _run(self, http_request: Request, requests: list[GenerationRequest],
                   reply: Reply) -> Response:
        fanout: Fanout | None = None

        async def start() -> None:
            nonlocal fanout
            # Each prompt is tokenized once (off the loop), one at a time: a request holds at most
            # one tokenization in the pool, so it can delay another request's by one at most.
            # Its n copies carry the token ids.
            budget = self.frontend.settings
            with refused_as_request_errors():
                check_request_budget([r.prompt for r in requests], reply.n, budget.max_request_bytes,
                                     budget.max_request_tokens)
            prompts: list[list[int]] = []
            for r in requests:
                prompts.append(await self.frontend.encode(r.prompt))
                with refused_as_request_errors():
                    check_request_tokens(sum(map(len, prompts)), reply.n, budget.max_request_tokens)
            operation = "chat" if reply.chat else "text_completion"
            choices = oai.fan_out(requests, reply.n, prompts)
            reply.starts, reply.resuming = http_resume.resume_points(
                http_request.headers.get(http_resume.HEADER), choices, reply.stream, reply.responses is None)
            reply.event_ids = http_resume.wants_event_ids(http_request.headers)
            for index, start in enumerate(reply.starts):  # what the client had of a choice it saw end
                if start.finished:
                    reply.choices[index].usage = Usage(len(prompts[index // reply.n]), start.num_output_tokens, 0)
            fanout = Fanout([http_resume.ended() if start.finished else self.frontend.generate(
                http_resume.resumed_request(r, start, reply.resuming), trace_headers=http_request.headers,
                operation=operation) for r, start in zip(choices, reply.starts, strict=True)])
            if reply.stream:
                await fanout.started()
                for _, out in fanout.pending:
                    reply.note(out)
                return
            async for index, out in fanout.events():
                reply.note(out)
                reply.choices[index].add(out)

        handed_over = False  # a streaming response closes the fan-out itself, when it ends
        try:
            await until_disconnect(http_request, start())
            assert fanout is not None
            if not reply.stream:
                await fanout.close()  # every stream has ended; closing leaves nothing to chance
                tokens = self.tokens

                def build() -> dict[str, Any]:
                    if reply.chat:
                        return render.chat_body(reply.request_id, reply.created, reply.model, reply.choices, reply.n,
                                                reply.want_logprobs, tokens, reply.tools, reply.want_prompt_logprobs)
                    return render.completion_body(reply.request_id, reply.created, reply.model, reply.choices,
                                                  reply.n, reply.want_logprobs, tokens, reply.echo,
                                                  reply.want_prompt_logprobs, reply.skip_special_tokens)

                view = reply.responses.from_chat if reply.responses is not None else None
                # Rendering n × max_tokens entries (with logprobs) is long work: a worker thread
                # keeps the loop serving other requests meanwhile.
                body = await asyncio.to_thread(lambda: json.dumps(
                    (view or dict)(build()), ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode())
                return Response(body, media_type="application/json", headers=reply.headers)
            events = self._chat_events if reply.chat else self._completion_events
            sse = (self._stream(fanout, events(fanout, reply), reply) if reply.responses is None
                   else self._responses_stream(fanout, events(fanout, reply), reply, reply.responses))
            response = FanoutStreamingResponse(fanout, sse, media_type="text/event-stream",
                                               headers={"Cache-Control": "no-cache", **reply.headers})
            handed_over = True
            return response
        except RequestError as exc:
            return request_error_response(exc, reply.aliases)
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; nginx's code for "client closed"
        finally:
            if fanout is not None and not handed_over:
                await fanout.close()

    async def _stream(self, fanout: Fanout, events: AsyncIterator[list[Chunk]],
                      reply: Reply) -> AsyncIterator[str]:
        """Each output's chunks in one write; the last carries the event id (when the client asked
        for ids), so that a client cut off inside an output's chunks resumes from the output before."""
        try:
            async for chunks in events:
                *before, last = chunks
                written = sse(last, reply.event_id() if reply.event_ids else "")
                yield "".join([*map(sse, before), written]) if before else written
            if reply.include_usage:
                yield sse(reply.chunk([], usage=render.usage(reply.choices, reply.n)))
        except RequestError as exc:  # mid-stream: the status line is long gone; OpenAI's clients read this
            yield sse(oai.request_error_body(exc, reply.aliases)[1])
        except Exception as exc:
            logger.exception("HTTP stream failed")
            yield sse(oai.error_body(f"internal error: {type(exc).__name__}", "internal_error"))
        finally:
            await fanout.close()
        yield "data: [DONE]\n\n"

    async def _responses_stream(self, fanout: Fanout, events: AsyncIterator[list[Chunk]], reply: Reply,
                                view: responses_api.ResponsesView) -> AsyncIterator[str]:
        """The Responses API's events over the chat chunks, the usage chunk last."""
        async def with_usage() -> AsyncIterator[dict[str, Any]]:
            async for chunks in events:
                for chunk in chunks:
                    assert not isinstance(chunk, str), "rendered chunks are SSE's alone (no Responses view)"
                    yield chunk
            yield reply.chunk([], usage=render.usage(reply.choices, reply.n))

        try:
            async for text in responses_events.stream(view, with_usage(), reply.aliases):
                yield text
        finally:
            await fanout.close()

    async def _completion_events(self, fanout: Fanout, reply: Reply) -> AsyncIterator[list[Chunk]]:
        characters = [0] * len(reply.choices)  # each choice's text_offset so far (its tokens' bytes)
        async for index, out in fanout.events():
            choice = reply.choices[index]
            choice.add(out)
            if out.resumed_token_ids:  # a resumed stream: offsets go on from the tokens the client has
                characters[index] = render.text_offsets(out.resumed_token_ids, self.tokens,
                                                        skip_special=reply.skip_special_tokens)[1]
            if not (out.text or out.finish_reason or out.logprobs):
                continue
            if not reply.want_logprobs:
                yield [reply.plain_chunk(index, out.text, render.finish_reason(out.finish_reason))]
                continue
            offsets, characters[index] = render.text_offsets(out.token_ids, self.tokens, characters[index],
                                                             reply.skip_special_tokens)
            logprobs = render.completion_logprobs(out.logprobs, out.token_ids, self.tokens, offsets)
            yield [reply.chunk([{"index": index, "text": out.text, "logprobs": logprobs,
                                 "finish_reason": render.finish_reason(out.finish_reason)}])]

    async def _chat_events(self, fanout: Fanout, reply: Reply) -> AsyncIterator[list[Chunk]]:
        def chunk(index: int, delta: dict[str, Any], logprobs: Any = None, finish: str | None = None) -> dict:
            return reply.chunk([{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}])

        parsers = [make_parser(reply.tools) for _ in reply.choices]
        legacy, calls_reason = render.legacy_calls(reply.tools), render.calls_finish_reason(reply.tools)
        if not reply.resuming:  # OpenAI opens every choice with the role (a resumed client has it)
            yield [chunk(index, {"role": "assistant", "content": ""}) for index in range(len(reply.choices))]
        async for index, out in fanout.events():
            reply.choices[index].add(out)
            parser = parsers[index]
            if parser is not None and out.resumed_text:  # where the client's parser stood: its deltas were sent
                parser.feed(out.resumed_text)
            if not (out.text or out.finish_reason or out.logprobs):
                continue
            logprobs = (render.chat_logprobs(out.logprobs, out.token_ids, self.tokens)
                        if reply.want_logprobs else None)
            if parser is None:
                if logprobs is None and reply.responses is None:  # the Responses API reads the chunks' fields
                    yield [reply.plain_chunk(index, out.text, render.finish_reason(out.finish_reason))]
                    continue
                yield [chunk(index, {"content": out.text} if out.text else {}, logprobs,
                             render.finish_reason(out.finish_reason))]
                continue
            chunks: list[Chunk] = []
            for delta in _tool_deltas(parser, out.text, bool(out.finish_reason), logprobs is not None, legacy):
                chunks.append(chunk(index, delta, logprobs))
                logprobs = None
            if out.finish_reason:
                chunks.append(chunk(index, {}, None,
                                    render.finish_reason(out.finish_reason, calls_reason if parser.calls else None)))
            if chunks:
                yield chunks

    async def requested(self, model: str | None) -> str:
        """The model a body names: a LoRA adapter every group holds, else the served model."""
        served = self.served()
        return model if model and await self.frontend.adapters.resolve(model, served) else served

    async def completions(self, body: oai.CompletionRequest, request: Request) -> Response:
        model = await self.requested(body.model)
        requests = [replace(r, model=model) for r in oai.completion_requests(body, model)]
        return await self._run(request, requests, Reply(
            model, chat=False, prompts=len(requests), n=body.n, stream=body.stream,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            want_logprobs=body.logprobs is not None, aliases=oai.param_aliases(body),
            echo=render.echo_of(requests, oai.echo_without_generation(body), self.tokens) if body.echo else None,
            want_prompt_logprobs=body.prompt_logprobs is not None,
            skip_special_tokens=requests[0].sampling.skip_special_tokens if requests else True))

    async def chat_completions(self, body: oai.ChatCompletionRequest, request: Request) -> Response:
        model = await self.requested(body.model)
        tools = oai.chat_tools(body)
        generation, reader = self._reading_tools(replace(oai.chat_request(body, model, tools), model=model), tools)
        return await self._run(request, [generation], Reply(
            model, chat=True, prompts=1, n=body.n, stream=body.stream,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
            want_logprobs=body.logprobs, aliases=oai.param_aliases(body, tools), tools=reader,
            want_prompt_logprobs=body.prompt_logprobs is not None))

    async def responses(self, body: responses_api.ResponsesRequest, request: Request) -> Response:
        """Stateless: served as the chat completion it translates into."""
        generation, view, tools = responses_api.translate(body, self.served())
        generation, reader = self._reading_tools(generation, tools)
        return await self._run(request, [generation], Reply(
            view.model, chat=True, prompts=1, n=1, stream=body.stream, include_usage=True, want_logprobs=False,
            aliases=view.aliases, responses=view, tools=reader))

    def _reading_tools(self, generation: GenerationRequest, tools: ToolPlan | None
                       ) -> tuple[GenerationRequest, ToolReader | None]:
        """The request as the served tool-call format needs it decoded, and how its output is read."""
        reader, sampling = self.frontend.tool_format.reader(tools, generation.sampling)
        return replace(generation, sampling=sampling), reader

    async def models(self) -> dict[str, Any]:
        limits = self.frontend.loaded_limits()
        return {"object": "list", "data": [{"id": limits.name, "object": "model", "created": self.created,
                                            "owned_by": "vmesh", "root": limits.name,
                                            "max_model_len": limits.max_model_len},
                                           *await adapter_cards(self.frontend, limits.name, self.created)]}

    async def model(self, model: str) -> dict[str, Any]:
        """One /v1/models entry (OpenAI's GET /v1/models/{model}, the client's models.retrieve)."""
        cards = (await self.models())["data"]
        for card in cards:
            if card["id"] == model:
                return card
        raise oai.unknown_model(model, cards[0]["id"])


def build_app(frontend: FrontendCore, registry: CollectorRegistry | None,
              guard: ConnectionGuard | None = None) -> FastAPI:
    """`guard`: the connections' guard (HttpServer's), whose limit spares /health and /metrics."""
    app = FastAPI(title="vmesh", summary="OpenAI-compatible API of a vmesh frontend", docs_url=None,
                  redoc_url=None)
    routes = OpenAIRoutes(frontend)

    add_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if frontend.serving():
            return Response(status_code=200)
        message = "draining" if frontend.draining else "not ready: starting, or no scheduler/detokenizer reachable"
        return error_response(503, message, "service_unavailable_error")

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(registry) if registry is not None else b"", media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return await routes.models()

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        return await routes.model(model)

    @app.post("/v1/completions")
    async def completions(body: oai.CompletionRequest, request: Request) -> Response:
        return await routes.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: oai.ChatCompletionRequest, request: Request) -> Response:
        return await routes.chat_completions(body, request)

    @app.post("/v1/responses")
    async def responses(body: responses_api.ResponsesRequest, request: Request) -> Response:
        return await routes.responses(body, request)

    utility_api.add_routes(app, frontend)
    embeddings_api.add_routes(app, frontend)
    add_lora_routes(app, frontend)
    # The last added runs first: the key is checked before any body byte is read.
    app.add_middleware(BodyLimitMiddleware, limit=body_limit(frontend.settings.max_request_bytes))
    app.add_middleware(ApiKeyMiddleware, api_key=frontend.settings.api_key)
    if guard is not None:
        app.add_middleware(ConnectionLimitMiddleware, guard=guard)
    return app


class HttpServer:
    """uvicorn on the running event loop, bound at construction so that port 0 is known at once."""

    def __init__(self, frontend: FrontendCore, registry: CollectorRegistry | None, host: str, port: int,
                 tls_cert: str | None = None, tls_key: str | None = None, limit: int = LIMIT_CONCURRENCY):
        """`tls_cert`, `tls_key`: HTTPS with this certificate (the public port's), else HTTP.
        `limit`: connections, or requests in progress, past which the API answers 503 (health does not)."""
        self.socket = bind(host, port)
        bound = self.socket.getsockname()
        self.address = f"[{bound[0]}]:{bound[1]}" if ":" in bound[0] else f"{bound[0]}:{bound[1]}"
        settings = frontend.settings
        self.guard = ConnectionGuard(settings.http_header_timeout_s, settings.http_connections_per_peer, limit,
                                     settings.http_body_timeout_s)
        config = guarded_config(build_app(frontend, registry, self.guard), self.guard, log_config=None,
                                access_log=False, lifespan="off", timeout_graceful_shutdown=5,
                                timeout_keep_alive=KEEP_ALIVE_S, ssl_certfile=tls_cert, ssl_keyfile=tls_key)
        self.server = GuardedServer(config)
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[self.socket]))

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            await self.task
