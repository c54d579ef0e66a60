"""POST /v1/chat/completions, /v1/completions and /v1/responses (and their unversioned aliases) as Litestar
`@asgi` route handlers.

Litestar routes them (path normalisation, the route template the metrics label by, guards, the exception
handlers) and hands over the raw ASGI call: no `Request`, no dependency injection, no response object and no
task group for a stream, which together cost ~0.5 ms of the ~1.9 ms a gateway spent on a request that arrived
alone (bench/gateway.py --stagger-ms; docs/benchmarks.md). The routing itself costs ~15-25 us more than a dict
lookup in front of Litestar (bench/edge.py), so it is Litestar's. A request is: read the body, decode it
strictly, call the serving layer, send JSON or SSE. What Litestar leaves to an `@asgi` handler is done here:
OPTIONS and other methods are answered as Litestar answers an HTTP route, the body has its own limit
(`server.max_body_bytes`; Litestar's applies to its `Request`), and /schema documents the routes
(`document_generation_routes`). Errors leave through Litestar's exception handler, as on every route. A new
generation route is one `GenerationRoute` and its paths in `GENERATION_ROUTES`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from litestar import Litestar, asgi
from litestar.openapi.spec import OpenAPIMediaType, OpenAPIResponse, Operation, PathItem, Schema

from deltafin.app.body import json_request_body
from deltafin.app.disconnect import cancel_when, on_disconnect
from deltafin.app.request_context import STATS_KEY
from deltafin.app.services import Services
from deltafin.app.shutdown import Drain
from deltafin.errors import (
    ClientClosedRequest,
    DeltafinError,
    InvalidRequestError,
    MethodNotAllowedError,
    PayloadTooLargeError,
)
from deltafin.protocol.chat import ChatCompletionRequest
from deltafin.protocol.completions import CompletionRequest
from deltafin.protocol.decode import decode_request
from deltafin.protocol.messages import MessagesRequest
from deltafin.protocol.responses import ResponsesRequest
from deltafin.serving.context import RequestStats
from deltafin.serving.messages.output import error_event, sse
from deltafin.serving.sse import StreamingResponse

_encode = msgspec.json.Encoder().encode

_ALLOW = b"POST, OPTIONS"
_JSON_HEADERS = [(b"content-type", b"application/json")]
_SSE_HEADERS = [(b"cache-control", b"no-cache"), (b"content-type", b"text/event-stream; charset=utf-8")]


@dataclass(frozen=True)
class GenerationRoute:
    request_type: type
    summary: str
    operation_id: str
    #: the serving call: (services, decoded request, stats) -> JSON body or a StreamingResponse
    create: Callable[[Services, Any, RequestStats], Awaitable[Any]]
    #: how a stream of this route ends on an error the route's own body did not send (a shutdown's grace
    #: ending); None: an OpenAI error event and [DONE]
    stream_ending: Callable[[DeltafinError], bytes] | None = None


_CHAT = GenerationRoute(
    ChatCompletionRequest,
    "Create a chat completion",
    "ChatCompletions",
    lambda services, request, stats: services.chat.create(request, stats),
)
_COMPLETION = GenerationRoute(
    CompletionRequest,
    "Create a text completion",
    "Completions",
    lambda services, request, stats: services.completions.create(request, stats),
)

_RESPONSE = GenerationRoute(
    ResponsesRequest,
    "Create a model response (Responses API)",
    "Responses",
    lambda services, request, stats: services.responses.create(request, stats),
)

_MESSAGE = GenerationRoute(
    MessagesRequest,
    "Create a message (Anthropic Messages API)",
    "Messages",
    lambda services, request, stats: services.messages.create(request, stats),
    lambda error: sse(error_event(error)),
)

#: path -> route, the versioned path first (both are served and documented)
GENERATION_ROUTES: dict[str, GenerationRoute] = {
    "/v1/chat/completions": _CHAT,
    "/chat/completions": _CHAT,
    "/v1/completions": _COMPLETION,
    "/completions": _COMPLETION,
    "/v1/responses": _RESPONSE,
    "/responses": _RESPONSE,
    # Anthropic's clients append `?beta=true` (Claude Code, the SDK's client.beta): routing ignores the query.
    "/v1/messages": _MESSAGE,
}


class GenerationEndpoints:
    """Serves the generation routes for the route handlers it makes (`route_handlers`)."""

    def __init__(self, *, services: Callable[[str | None], Services], drain: Drain, max_body_bytes: int) -> None:
        self._services = services
        self._drain = drain
        self._max_body_bytes = max_body_bytes

    def route_handlers(self) -> list[Any]:
        """One `@asgi` handler per route, at every path `GENERATION_ROUTES` gives it."""
        handlers = []
        for route in dict.fromkeys(GENERATION_ROUTES.values()):
            paths = [path for path, each in GENERATION_ROUTES.items() if each is route]
            handlers.append(asgi(path=paths, copy_scope=False, name=route.operation_id)(self._handler(route)))
        return handlers

    def _handler(self, route: GenerationRoute) -> Callable[..., Awaitable[None]]:
        async def generation(scope: Any, receive: Any, send: Any) -> None:
            await self._handle(route, scope, receive, send)

        return generation

    async def _handle(self, route: GenerationRoute, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """OPTIONS and other methods as Litestar answers them on an HTTP route, then the request. An error
        raised before the response starts is answered by Litestar's exception handler (deltafin.app.errors), as
        on every route; one raised later reaches uvicorn, which logs it and closes the connection."""
        method = scope["method"]
        if method == "OPTIONS":
            await send({"type": "http.response.start", "status": 204, "headers": [(b"allow", _ALLOW)]})
            await send({"type": "http.response.body", "body": b""})
            return
        if method != "POST":
            raise MethodNotAllowedError("Method Not Allowed", headers={"Allow": _ALLOW.decode()})
        await self._serve(route, scope, receive, send)

    async def _serve(self, route: GenerationRoute, scope: dict[str, Any], receive: Any, send: Any) -> None:
        stats = scope.get("state", {}).get(STATS_KEY)
        if stats is None:
            stats = RequestStats()
        raw = await read_body(scope, receive, self._max_body_bytes)
        stats.body_bytes = len(raw)  # chooses the prompt-work lane (deltafin.serving.prompt_work)
        request: Any = decode_request(raw, route.request_type)
        services = self._services(request.model)  # the model the request names (deltafin.app.served)
        stats.answered_by(services.ctx)

        def admitted() -> bool:
            return stats.queue_wait_s is not None

        # Queue wait and non-streamed generation stop at the client's disconnect or a shutdown
        # (deltafin.app.shutdown); a streamed body stops when the client goes (send_event_stream) or the drain's
        # grace ends.
        result = await cancel_when(
            route.create(services, request, stats), [on_disconnect(receive), self._drain.stopper(admitted)], _close
        )
        if isinstance(result, StreamingResponse):
            head = {"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS}
            if result.ready:  # the first chunk comes at once: the head leaves with it, one wake-up for the client
                send = _after(head, send)
            else:
                await send(head)
            await send_event_stream(self._drain.stream(result.body, route.stream_ending), receive, send)
            return
        body = _encode(result)
        headers = [*_JSON_HEADERS, (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _after(first: dict[str, Any], send: Any) -> Callable[[dict[str, Any]], Awaitable[None]]:
    """`send` that sends `first` just before the first message it is given."""
    pending = [first]

    async def send_after(message: dict[str, Any]) -> None:
        if pending:
            await send(pending.pop())
        await send(message)

    return send_after


def _close(result: Any) -> None:
    if isinstance(result, StreamingResponse):
        result.close()


async def read_body(scope: dict[str, Any], receive: Any, limit: int) -> bytes:
    """The whole request body; 413 past `limit` (before reading anything when Content-Length says so)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                declared = int(value)
            except ValueError:
                raise InvalidRequestError(f"Invalid content-length: {value.decode('latin-1')!r}") from None
            if declared > limit:
                raise PayloadTooLargeError("Request Entity Too Large")
            break
    parts: list[bytes] = []
    total = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientClosedRequest("client disconnected while sending its body")
        chunk = message.get("body", b"")
        if chunk:
            total += len(chunk)
            if total > limit:  # a chunked upload, or more than it declared
                raise PayloadTooLargeError("Request Entity Too Large")
            parts.append(chunk)
        if not message.get("more_body", False):
            break
    return parts[0] if len(parts) == 1 else b"".join(parts)


async def send_event_stream(chunks: Any, receive: Any, send: Any) -> None:
    """Send an SSE body (its start was sent) in this task; a watcher task cancels it when the client
    disconnects, at its current await, so its `finally` stops the generation and frees the upstream request.
    (Litestar sent a stream from an anyio task group: a task for the body and a cancel scope per response,
    which in front of an upstream cost more than the rest of the response.)"""
    task = asyncio.current_task()
    assert task is not None
    state = {"sending": True, "client_left": False}

    async def watch_for_disconnect() -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
        if state["sending"]:
            state["client_left"] = True
            task.cancel()

    watcher = asyncio.ensure_future(watch_for_disconnect())
    try:
        async for chunk in chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        state["sending"] = False
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    except asyncio.CancelledError:
        if state["client_left"] and task.uncancel() == 0:
            return  # the cancellation was ours: the client is gone, nothing more to send
        raise
    finally:
        state["sending"] = False
        watcher.cancel()
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()  # a body left at a `yield` (cancelled during a send) stops its generation too


def document_generation_routes(app: Litestar) -> None:
    """Put the generation routes into the app's (cached) OpenAPI document: Litestar does not route them, so
    it cannot infer them. Each takes its request type's schema (see deltafin.app.body.publish_body_schemas)
    and answers JSON, or server-sent events when `stream` is true."""
    openapi = app.openapi_schema
    paths = dict(openapi.paths or {})
    for path, route in GENERATION_ROUTES.items():
        body = json_request_body(route.request_type)
        answers = {
            "application/json": OpenAPIMediaType(schema=Schema(description="the whole response")),
            "text/event-stream": OpenAPIMediaType(schema=Schema(description="chunks, when `stream` is true")),
        }
        prefix = "V1" if path.startswith("/v1/") else ""
        operation = Operation(
            summary=route.summary,
            operation_id=prefix + route.operation_id,
            request_body=body,
            responses={"200": OpenAPIResponse(description="Request fulfilled", content=answers)},
        )
        paths[path] = PathItem(post=operation)
    openapi.paths = paths
