"""One error hierarchy: every failure a client can see, with its HTTP status and OpenAI fields."""

from __future__ import annotations

from typing import Any, ClassVar


class DeltafinError(Exception):
    """Base of every error rendered to a client as `{"error": {message, type, param, code}}`."""

    status: ClassVar[int] = 500
    type: ClassVar[str] = "internal_error"
    default_code: ClassVar[str | None] = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class InvalidRequestError(DeltafinError):
    status = 400
    type = "invalid_request_error"


class ContextLengthError(InvalidRequestError):
    """The prompt (plus the requested completion) does not fit the model's context."""

    default_code = "context_length_exceeded"

    def __init__(
        self, message: str, *, context_length: int, prompt_tokens: int, completion_tokens: int = 0, **kwargs: Any
    ) -> None:
        super().__init__(message, param=kwargs.pop("param", "messages"), **kwargs)
        self.context_length = context_length
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens  # the completion budget asked for (0: none)


class AuthenticationError(DeltafinError):
    status = 401
    type = "authentication_error"
    default_code = "invalid_api_key"


class NotFoundError(DeltafinError):
    status = 404
    type = "not_found_error"


#: a name the server does not know is quoted back in its 404 up to this many characters (a client may send megabytes)
QUOTED_NAME_CHARS = 200


def quoted_name(name: str) -> str:
    """`name` as an error message quotes it: cut to QUOTED_NAME_CHARS."""
    return name if len(name) <= QUOTED_NAME_CHARS else name[:QUOTED_NAME_CHARS] + "..."


class ModelNotFoundError(NotFoundError):
    type = "invalid_request_error"
    default_code = "model_not_found"


class MethodNotAllowedError(DeltafinError):
    status = 405
    type = "invalid_request_error"
    default_code = "method_not_allowed"


class RequestTimeoutError(DeltafinError):
    """The client did not send its whole body in time (a slow or stalled upload); the connection is closed."""

    status = 408
    type = "invalid_request_error"
    default_code = "request_timeout"


class HeadersTooLargeError(DeltafinError):
    """The request line and headers are over `server.connections.max_header_bytes`; the connection is closed."""

    status = 431
    type = "invalid_request_error"
    default_code = "request_header_fields_too_large"


class PayloadTooLargeError(DeltafinError):
    status = 413
    type = "PayloadTooLargeError"
    default_code = "payload_too_large"


class EngineBusyError(DeltafinError):
    """The single engine is taken and the queue is full or the wait timed out; clients should retry."""

    status = 429
    type = "rate_limit_error"
    default_code = "engine_busy"


class EngineUnavailableError(DeltafinError):
    status = 503
    type = "service_unavailable_error"
    default_code = "model_loading"


class ShuttingDownError(EngineUnavailableError):
    """The server got SIGTERM/SIGINT: it takes no new work, and work past the shutdown grace is cancelled."""

    default_code = "server_shutting_down"


class UpstreamUnavailableError(EngineUnavailableError):
    """The upstream engine cannot be reached (or says it is not ready); the message names it."""

    default_code = "upstream_unavailable"


class UpstreamBusyError(EngineBusyError):
    """The upstream engine's own queue is full; clients should retry after Retry-After."""

    default_code = "upstream_busy"


class UpstreamError(DeltafinError):
    """The upstream answered 5xx, an unexpected status, or a stream Deltafin cannot read."""

    status = 502
    type = "upstream_error"
    default_code = "upstream_error"


class UpstreamTimeoutError(UpstreamError):
    """No byte from the upstream within `engine.read_timeout_s`."""

    status = 504
    default_code = "upstream_timeout"


class InternalError(DeltafinError):
    status = 500
    type = "internal_error"
    default_code = "internal_error"


def error_for_status(status: int, message: str) -> DeltafinError:
    """The Deltafin error that stands for a bare HTTP status raised by the web framework."""
    by_status: dict[int, type[DeltafinError]] = {
        400: InvalidRequestError,
        401: AuthenticationError,
        404: NotFoundError,
        408: RequestTimeoutError,
        405: MethodNotAllowedError,
        413: PayloadTooLargeError,
        429: EngineBusyError,
        503: EngineUnavailableError,
    }
    cls = by_status.get(status)
    if cls is not None:
        return cls(message)
    if 400 <= status < 500:
        err = InvalidRequestError(message)
        err.status = status  # type: ignore[misc]  # this instance carries the 4xx it was given (a ClassVar elsewhere)
        return err
    return InternalError(message)


class ClientClosedRequest(DeltafinError):
    """The client went away before its answer; nobody reads this (499, as nginx logs it)."""

    status = 499
    type = "client_closed_request"


#: Anthropic's error type for a status (the Messages routes answer in Anthropic's shape); any other 4xx is an
#: invalid_request_error, any other 5xx an api_error
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def anthropic_error(error: DeltafinError, request_id: str | None = None) -> tuple[int, dict[str, Any]]:
    """(status, body) of `error` as Anthropic's API answers: `{"type": "error", "error": {"type", "message"}}`.
    A 503 (a model still loading, a server draining, an upstream down) is Anthropic's 529 overloaded_error, which
    its clients retry with backoff, as they would a 503."""
    status = 529 if error.status == 503 else error.status
    kind = _ANTHROPIC_TYPES.get(status) or ("invalid_request_error" if status < 500 else "api_error")
    body: dict[str, Any] = {"type": "error", "error": {"type": kind, "message": error.message}}
    if request_id is not None:
        body["request_id"] = request_id
    return status, body
