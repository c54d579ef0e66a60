"""Thin HTTP routes: decode (Litestar + msgspec), call the serving layer, answer JSON. (The generation routes,
/v1/chat/completions and /v1/completions, are a plain ASGI layer in front of these: deltafin.app.generation.)"""

from __future__ import annotations

from typing import Any

from litestar import Request, delete, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery

from deltafin.app.body import documented_body, strict_body
from deltafin.app.request_context import STATS_KEY
from deltafin.app.served import ServedModels
from deltafin.errors import InvalidRequestError
from deltafin.protocol.chat import ChatCompletionRequest
from deltafin.protocol.completions import CompletionRequest
from deltafin.protocol.messages import CountTokensRequest, MessagesRequest
from deltafin.protocol.parse import ParseRequest
from deltafin.protocol.responses import InputItemsQuery, ResponsesRequest
from deltafin.protocol.tokenize import DetokenizeRequest, TokenizeRequest
from deltafin.serving.chat import brings_template
from deltafin.serving.context import RequestStats
from deltafin.serving.models import get_model, list_models

#: The request types whose schemas /schema publishes (deltafin.app.body.publish_body_schemas), the generation
#: routes' included.
BODY_TYPES = [
    ChatCompletionRequest,
    CompletionRequest,
    ResponsesRequest,
    MessagesRequest,
    CountTokensRequest,
    TokenizeRequest,
    DetokenizeRequest,
    ParseRequest,
]


def _body(request_type: type) -> dict[str, Any]:
    """Route options that decode the body strictly as `payload` and document it in /schema."""
    return {"dependencies": {"payload": strict_body(request_type)}, "operation_class": documented_body(request_type)}


def _stats(request: Request) -> RequestStats:
    stats = request.scope.get("state", {}).get(STATS_KEY)
    return stats if stats is not None else RequestStats()


@get(["/v1/models", "/models"], summary="List the served models")
async def list_served(models: NamedDependency[ServedModels]) -> dict[str, Any]:
    models.any()  # 503 while no model is loaded yet (or none loaded), as every route
    return list_models([services.ctx for services in models.loaded()])


@get(["/v1/models/{name:str}", "/models/{name:str}"], summary="Describe a served model")
async def model(name: FromPath[str], models: NamedDependency[ServedModels]) -> dict[str, Any]:
    return get_model(models.require(name).ctx, name)


@post(
    ["/tokenize", "/v1/tokenize"],
    status_code=200,
    summary="Tokenize a prompt or chat messages",
    **_body(TokenizeRequest),
)
async def tokenize(
    request: Request, payload: NamedDependency[TokenizeRequest], models: NamedDependency[ServedModels]
) -> dict[str, Any]:
    stats = _stats(request)
    services = models.require(payload.model)
    stats.answered_by(services.ctx)
    return await services.ctx.off_loop(
        services.tokenize.tokenize,
        payload,
        stats,
        size=stats.body_bytes,
        stats=stats,
        inline=not brings_template(payload),
    )


@post(
    ["/detokenize", "/v1/detokenize"],
    status_code=200,
    summary="Turn token ids back into text",
    **_body(DetokenizeRequest),
)
async def detokenize(
    payload: NamedDependency[DetokenizeRequest], models: NamedDependency[ServedModels]
) -> dict[str, Any]:
    services = models.require(payload.model)
    return await services.ctx.off_loop(services.tokenize.detokenize, payload)


@post(
    ["/parse", "/v1/parse"],
    status_code=200,
    summary="Parse raw model output with the served model's parsers",
    **_body(ParseRequest),
)
async def parse(payload: NamedDependency[ParseRequest], models: NamedDependency[ServedModels]) -> dict[str, Any]:
    services = models.require(payload.model)
    # Its cost grows with the text: in the prompt lane for its size (a large one beside other large bodies).
    return await services.ctx.off_loop(services.parse.parse, payload, size=len(payload.text), inline=False)


@post(
    "/v1/messages/count_tokens",
    status_code=200,
    summary="Count the input tokens of a message (Anthropic Messages API)",
    **_body(CountTokensRequest),
)
async def count_message_tokens(
    request: Request, payload: NamedDependency[CountTokensRequest], models: NamedDependency[ServedModels]
) -> dict[str, Any]:
    stats = _stats(request)
    services = models.require(payload.model)
    stats.answered_by(services.ctx)
    return await services.messages.count_tokens(payload, stats)


# The Responses API's stored responses (POST /v1/responses is a generation route: deltafin.app.generation). The
# store is the process's, whichever model answered: any loaded model's service reads it.
@get(["/v1/responses/{response_id:str}", "/responses/{response_id:str}"], summary="Retrieve a stored response")
async def retrieve_response(
    request: Request, response_id: FromPath[str], models: NamedDependency[ServedModels]
) -> dict[str, Any]:
    return await models.any().responses.retrieve(_stats(request).owner, response_id)


@delete(
    ["/v1/responses/{response_id:str}", "/responses/{response_id:str}"],
    status_code=200,
    summary="Delete a stored response",
)
async def delete_response(
    request: Request, response_id: FromPath[str], models: NamedDependency[ServedModels]
) -> dict[str, Any]:
    return await models.any().responses.delete(_stats(request).owner, response_id)


@get(
    ["/v1/responses/{response_id:str}/input_items", "/responses/{response_id:str}/input_items"],
    summary="List a stored response's input items",
)
async def response_input_items(
    request: Request,
    response_id: FromPath[str],
    models: NamedDependency[ServedModels],
    limit: FromQuery[int] = 20,
    order: FromQuery[str] = "desc",
    after: FromQuery[str | None] = None,
) -> dict[str, Any]:
    if not 1 <= limit <= 100:
        raise InvalidRequestError("limit must be between 1 and 100", param="limit")
    query = InputItemsQuery(limit=limit, order=order, after=after)
    return await models.any().responses.input_items(_stats(request).owner, response_id, query)


ROUTES = [
    list_served,
    model,
    tokenize,
    detokenize,
    parse,
    count_message_tokens,
    retrieve_response,
    delete_response,
    response_input_items,
]
