"""Thin HTTP routes: decode (Litestar + msgspec), call the serving layer, wrap JSON or SSE."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath

from deltafin.app.body import documented_body, strict_body
from deltafin.app.disconnect import cancel_when, on_disconnect
from deltafin.app.event_stream import EventStream
from deltafin.app.request_context import STATS_KEY
from deltafin.app.services import Services
from deltafin.app.shutdown import Drain
from deltafin.protocol.chat import ChatCompletionRequest
from deltafin.protocol.completions import CompletionRequest
from deltafin.protocol.parse import ParseRequest
from deltafin.protocol.tokenize import DetokenizeRequest, TokenizeRequest
from deltafin.serving.chat import brings_template
from deltafin.serving.context import RequestStats
from deltafin.serving.models import get_model, list_models
from deltafin.serving.sse import StreamingResponse


#: The request types whose schemas /schema publishes (deltafin.app.body.publish_body_schemas).
BODY_TYPES = [ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest, ParseRequest]


def _body(request_type: type) -> dict[str, Any]:
    """Route options that decode the body strictly as `payload` and document it in /schema."""
    return {"dependencies": {"payload": strict_body(request_type)}, "operation_class": documented_body(request_type)}


def _stats(request: Request) -> RequestStats:
    stats = request.scope.get("state", {}).get(STATS_KEY)
    return stats if stats is not None else RequestStats()


def _close(result: Any) -> None:
    if isinstance(result, StreamingResponse):
        result.close()


async def _respond(request: Request, work: Any) -> Response | EventStream:
    # Queue wait and non-streamed generation stop at the client's disconnect or a shutdown (deltafin.app.shutdown);
    # a streamed body stops when the client goes (deltafin.app.event_stream) or the drain's grace ends.
    drain: Drain = request.app.state.drain
    stats = _stats(request)

    def admitted() -> bool:
        return stats.queue_wait_s is not None

    result = await cancel_when(work, [on_disconnect(request.receive), drain.stopper(admitted)], _close)
    if isinstance(result, StreamingResponse):
        return EventStream(drain.stream(result.body), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return Response(result)


@post(["/v1/chat/completions", "/chat/completions"], status_code=200, summary="Create a chat completion", **_body(ChatCompletionRequest))
async def chat_completions(
    request: Request, payload: NamedDependency[ChatCompletionRequest], services: NamedDependency[Services]
) -> Response | EventStream:
    return await _respond(request, services.chat.create(payload, _stats(request)))


@post(["/v1/completions", "/completions"], status_code=200, summary="Create a text completion", **_body(CompletionRequest))
async def completions(
    request: Request, payload: NamedDependency[CompletionRequest], services: NamedDependency[Services]
) -> Response | EventStream:
    return await _respond(request, services.completions.create(payload, _stats(request)))


@get(["/v1/models", "/models"], summary="List the served model")
async def models(services: NamedDependency[Services]) -> dict[str, Any]:
    return list_models(services.ctx)


@get(["/v1/models/{name:str}", "/models/{name:str}"], summary="Describe the served model")
async def model(name: FromPath[str], services: NamedDependency[Services]) -> dict[str, Any]:
    return get_model(services.ctx, name)


@post(["/tokenize", "/v1/tokenize"], status_code=200, summary="Tokenize a prompt or chat messages", **_body(TokenizeRequest))
async def tokenize(
    request: Request, payload: NamedDependency[TokenizeRequest], services: NamedDependency[Services]
) -> dict[str, Any]:
    stats = _stats(request)
    return await services.ctx.off_loop(services.tokenize.tokenize, payload, stats, size=stats.body_bytes, stats=stats,
                                       inline=not brings_template(payload))


@post(["/detokenize", "/v1/detokenize"], status_code=200, summary="Turn token ids back into text", **_body(DetokenizeRequest))
async def detokenize(payload: NamedDependency[DetokenizeRequest], services: NamedDependency[Services]) -> dict[str, Any]:
    return await services.ctx.off_loop(services.tokenize.detokenize, payload)


@post(["/parse", "/v1/parse"], status_code=200, summary="Parse raw model output with the served model's parsers", **_body(ParseRequest))
async def parse(payload: NamedDependency[ParseRequest], services: NamedDependency[Services]) -> dict[str, Any]:
    return await services.ctx.off_loop(services.parse.parse, payload)


ROUTES = [chat_completions, completions, models, model, tokenize, detokenize, parse]
