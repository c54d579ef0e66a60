"""Server-sent events: the body of a streamed response, and a handle that stops its generation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import msgspec

from deltafin.errors import DeltafinError

_encoder = msgspec.json.Encoder()

DONE = b"data: [DONE]\n\n"


def sse_event(payload: Any) -> bytes:
    return b"data: " + _encoder.encode(payload) + b"\n\n"


@dataclass
class ChunkStream:
    """Chunk dicts of a streamed response, before rules and encoding; `close()` stops the generation."""

    chunks: AsyncIterator[dict]
    close: Callable[[], None]


@dataclass
class StreamingResponse:
    """An SSE body that has not started yet; `close()` stops its generation even if it never runs."""

    body: AsyncIterator[bytes]
    close: Callable[[], None]


async def encode_sse(
    chunks: AsyncIterator[dict], map_error: Callable[[DeltafinError], DeltafinError], close: Callable[[], None]
) -> AsyncIterator[bytes]:
    """SSE framing; an error after the status was sent can only be an in-stream error event (no [DONE]).
    However the body ends (done, failed, cancelled by a disconnect), the generation is stopped."""
    try:
        async for chunk in chunks:
            yield sse_event(chunk)
        yield DONE
    except DeltafinError as exc:
        yield sse_event(map_error(exc).body())
    finally:
        close()
