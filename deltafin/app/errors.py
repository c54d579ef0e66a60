"""The one exception handler: every error leaves with its real status, as an OpenAI-shaped body, or on the
Anthropic routes (/v1/messages...) as Anthropic's (deltafin.errors.anthropic_error)."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import structlog
from litestar import Request, Response
from litestar.exceptions import HTTPException, NotFoundException, ValidationException

from deltafin.errors import (
    DeltafinError,
    InternalError,
    InvalidRequestError,
    NotFoundError,
    anthropic_error,
    error_for_status,
)

log = structlog.get_logger("deltafin.errors")

_MISSING_FIELD = re.compile(r"missing required field `([^`]+)`")


def to_deltafin_error(exc: Exception) -> DeltafinError:
    if isinstance(exc, DeltafinError):
        return exc
    if isinstance(exc, ValidationException):
        return _validation_error(exc)
    if isinstance(exc, HTTPException):
        err = error_for_status(exc.status_code, exc.detail)
        err.headers.update(exc.headers or {})
        return err
    log.exception("unhandled_error", exc_info=exc)
    return InternalError("The server failed to handle this request; see the server log.")


def _validation_error(exc: ValidationException) -> InvalidRequestError:
    """Litestar reports body decoding problems as a list; the first one names the field."""
    problems = exc.extra if isinstance(exc.extra, list) else []
    if not problems:
        return InvalidRequestError(exc.detail)
    first = problems[0] if isinstance(problems[0], dict) else {"message": str(problems[0])}
    key = first.get("key")
    message = first.get("message", exc.detail)
    missing = _MISSING_FIELD.search(message)
    if missing:
        parent = "" if key in (None, "data", "body") else f"{key}."
        return InvalidRequestError(
            f"Missing required field `{parent}{missing.group(1)}`", param=parent + missing.group(1)
        )
    if key in (None, "data", "body"):
        if "JSON is malformed" in message or "malformed" in message.lower():
            return InvalidRequestError(f"The request body is not valid JSON: {message}")
        return InvalidRequestError(f"Invalid request body: {message}")
    return InvalidRequestError(f"Invalid value for `{key}`: {message}", param=key)


#: where Anthropic's API is served: errors there leave in its shape
ANTHROPIC_PREFIX = "/v1/messages"
#: where the request id is kept for an error body (deltafin.app.request_context)
REQUEST_ID_KEY = "deltafin_request_id"


def speaks_anthropic(path: str) -> bool:
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def error_answer(err: DeltafinError, scope: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
    """(status, body) of `err` in the shape of the route `scope` asked for."""
    if scope is not None and speaks_anthropic(scope.get("path", "")):
        return anthropic_error(err, scope.get("state", {}).get(REQUEST_ID_KEY))
    return err.status, err.body()


#: what a client that reached an unserved route (embeddings, responses, audio, ...) is told instead
SERVED = (
    "Deltafin serves the OpenAI chat completions and Responses APIs and Anthropic's Messages API: POST "
    "/v1/chat/completions, POST /v1/completions, POST /v1/responses (GET and DELETE /v1/responses/{id}, GET "
    "/v1/responses/{id}/input_items), POST /v1/messages, POST /v1/messages/count_tokens, GET /v1/models (plus "
    "/tokenize, /detokenize, /parse, /health, /metrics)."
)


def handle_exception(request: Request, exc: Exception) -> Response:
    if type(exc) is NotFoundException:  # the router found no route (handlers raise DeltafinErrors)
        exc = NotFoundError(f"{request.method} {request.url.path} is not served. {SERVED}", code="route_not_found")
    err = to_deltafin_error(exc)
    status, body = error_answer(err, request.scope)  # type: ignore[arg-type]  # Litestar's Scope is a TypedDict; error_answer reads it as a plain dict
    return Response(body, status_code=status, headers=err.headers)


async def send_error(
    send: Callable[[dict[str, Any]], Awaitable[None]], err: DeltafinError, scope: dict[str, Any] | None = None
) -> None:
    """Answer with `err` straight from an ASGI layer that runs before Litestar (auth, shutdown)."""
    status, answer = error_answer(err, scope)
    body = msgspec.json.encode(answer)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in err.headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
