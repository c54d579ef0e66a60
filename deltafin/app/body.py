"""JSON request bodies decoded strictly (deltafin.protocol.decode), and their schemas in /schema.

Litestar's own body conversion coerces `"2"` to 2 and lets a deeply nested body raise RecursionError, so the
API routes read the raw bytes through `strict_body` instead; `documented_body` puts the request type's schema
back into the OpenAPI document (with `publish_body_schemas`) that Litestar can no longer infer from the handler's
signature.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from litestar import Litestar, Request
from litestar.di import Provide
from litestar.openapi.spec import OpenAPIMediaType, Operation, Reference, RequestBody

from deltafin.app.request_context import STATS_KEY
from deltafin.protocol.decode import decode_request, public_schema_components

T = TypeVar("T")


def strict_body(request_type: type[T]) -> Provide:
    """A dependency that yields the request body decoded as `request_type` (400 on anything else)."""

    async def provide(request: Request) -> T:
        raw = await request.body()
        stats = request.scope.get("state", {}).get(STATS_KEY)
        if stats is not None:
            stats.body_bytes = len(raw)  # chooses the prompt-work lane (deltafin.serving.prompt_work)
        return decode_request(raw, request_type)

    provide.__annotations__["return"] = request_type
    return Provide(provide)


def documented_body(request_type: type) -> type[Operation]:
    """An Operation class whose request body is `request_type`'s schema (see `publish_body_schemas`)."""

    @dataclass
    class WithBody(Operation):
        def __post_init__(self) -> None:
            self.request_body = json_request_body(request_type)

    return WithBody


def json_request_body(request_type: type) -> RequestBody:
    """A required JSON body whose schema is `request_type`'s entry in the components."""
    schema = Reference(ref=f"#/components/schemas/{request_type.__name__}")
    return RequestBody(content={"application/json": OpenAPIMediaType(schema=schema)}, required=True)


def publish_body_schemas(app: Litestar, types: Sequence[type]) -> None:
    """Add the request types' schemas to the app's OpenAPI components. Litestar fills `components.schemas`
    with the ones it inferred itself, so they are merged into the (cached) document once it is built."""
    openapi = app.openapi_schema
    openapi.components.schemas = {**public_schema_components(types), **(openapi.components.schemas or {})}
