"""The streamed (SSE) response: Litestar's `Stream`, with the body sent by a plain asyncio loop.

Litestar sends a stream's body from an anyio task group: a task for the body, the request's own task listening
for the client's disconnect, and a cancel scope between them. In front of an upstream that machinery cost more
per request than the rest of the response. Here the body runs in the request's own task and a small watcher
task cancels it when the client disconnects; the effect is the same (the body generator is cancelled at its
await, so its `finally` stops the generation and frees the upstream request).
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from litestar.response import Stream
from litestar.response.base import ASGIResponse


class EventStream(Stream):
    def to_asgi_response(self, *args: Any, **kwargs: Any) -> ASGIResponse:
        return _SentInThisTask(super().to_asgi_response(*args, **kwargs))  # type: ignore[return-value]


class _SentInThisTask:
    """An ASGI app: Litestar's streaming response (status, headers, cookies, background tasks) around our loop."""

    def __init__(self, response: Any) -> None:
        self._response = response

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        response = self._response
        await response.start_response(send=send)
        if response.is_head_response:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        else:
            await _send_body(response.iterator, receive, send)
        await response.after_response()


async def _send_body(chunks: AsyncIterator[bytes], receive: Any, send: Any) -> None:
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
