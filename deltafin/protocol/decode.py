"""Strict decoding of request bodies: raw JSON bytes -> the typed request, or a 400 naming the field.

Strict means what docs/api.md promises and OpenAI does: `"max_tokens": "2"`, `"stream": "true"` and
`"n": 1.0` are type errors, not silently coerced (Litestar's own body conversion is lax, so routes decode
with this instead).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, TypeVar

import msgspec

from deltafin.errors import InvalidRequestError

T = TypeVar("T")

_PATH = re.compile(r" - at `\$\.?([^`]*)`$")
_MISSING = re.compile(r"^Object missing required field `([^`]+)`")


def decode_request(raw: bytes, request_type: type[T]) -> T:
    """Decode `raw` into `request_type` with no type coercion; every failure is an InvalidRequestError."""
    try:
        request = msgspec.json.decode(raw, type=request_type, strict=True)
    except RecursionError:
        # msgspec's decoder refuses very deep nesting this way; it is the client's body, not a server fault.
        raise InvalidRequestError("The request body is nested too deeply.") from None
    except msgspec.ValidationError as exc:
        raise _validation_error(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequestError(f"The request body is not valid JSON: {exc}") from None
    return request


def _validation_error(text: str) -> InvalidRequestError:
    match = _PATH.search(text)
    path = match.group(1) if match else ""
    message = text[: match.start()] if match else text
    missing = _MISSING.match(message)
    if missing:
        param = f"{path}.{missing.group(1)}" if path else missing.group(1)
        return InvalidRequestError(f"Missing required field `{param}`", param=param)
    if not path:
        return InvalidRequestError(f"Invalid request body: {message}")
    return InvalidRequestError(f"Invalid value for `{path}`: {message}", param=path)


def public_schema_components(types: Sequence[type]) -> dict[str, Any]:
    """JSON schemas of the request types as OpenAPI components."""
    _, components = msgspec.json.schema_components(types, ref_template="#/components/schemas/{name}")
    return components
