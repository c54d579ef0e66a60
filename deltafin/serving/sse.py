"""Server-sent events: the body of a streamed response, and a handle that stops its generation."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from deltafin.errors import DeltafinError

_encoder = msgspec.json.Encoder()

DONE = b"data: [DONE]\n\n"


def sse_event(payload: Any) -> bytes:
    return b"data: " + _encoder.encode(payload) + b"\n\n"


class FollowedChunk(dict):
    """A chunk that the next one follows at once (both from one engine event, e.g. the role chunk and the first
    content): the two are framed into one write, so a client reads them with one wake-up. A rule that rebuilds
    the chunk drops the mark, which only costs the merge."""


@dataclass
class ChunkStream:
    """Chunk dicts of a streamed response, before rules and encoding; `close()` stops the generation.
    `ready`: the engine's first event is in already, so the first chunk comes without waiting."""

    chunks: AsyncIterator[dict]
    close: Callable[[], None]
    ready: bool = False


@dataclass
class StreamingResponse:
    """An SSE body that has not started yet; `close()` stops its generation even if it never runs.
    `ready`: its first bytes come without waiting (the response head may wait for them, to leave together)."""

    body: AsyncIterator[bytes]
    close: Callable[[], None]
    ready: bool = False


async def encode_sse(
    chunks: AsyncIterator[dict], map_error: Callable[[DeltafinError], DeltafinError], close: Callable[[], None]
) -> AsyncIterator[bytes]:
    """SSE framing; an error after the status was sent can only be an in-stream error event (no [DONE]).
    However the body ends (done, failed, cancelled by a disconnect), the generation is stopped."""
    held = b""  # a FollowedChunk's event, sent with the next one
    try:
        async for chunk in chunks:
            event = sse_event(chunk)
            if isinstance(chunk, FollowedChunk):
                held += event
                continue
            yield held + event if held else event
            held = b""
        yield held + DONE
    except DeltafinError as exc:
        yield held + sse_event(map_error(exc).body())
    finally:
        close()
