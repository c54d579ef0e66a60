"""Server-sent events: the body of a streamed response, and a handle that stops its generation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import msgspec

_encoder = msgspec.json.Encoder()

DONE = b"data: [DONE]\n\n"


def sse_event(payload: Any) -> bytes:
    return b"data: " + _encoder.encode(payload) + b"\n\n"


@dataclass
class StreamingResponse:
    """An SSE body that has not started yet; `close()` stops its generation even if it never runs."""

    body: AsyncIterator[bytes]
    close: Callable[[], None]
