"""Graceful shutdown. On SIGTERM/SIGINT the server stops taking work but lets generations already running
finish within `server.shutdown_grace_s`:

- new requests (on connections still open) and requests not yet admitted to the engine: 503 JSON
  `server_shutting_down` with Retry-After, so clients and load balancers retry elsewhere;
- non-streamed generations still running when the grace ends: the same 503;
- streams still running when the grace ends: an in-stream error event, then `data: [DONE]`.

Then uvicorn closes the connections and the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import structlog

from deltafin.app.disconnect import cancel_when
from deltafin.app.errors import send_error
from deltafin.errors import ShuttingDownError
from deltafin.serving.sse import DONE, sse_event

log = structlog.get_logger("deltafin.shutdown")

T = TypeVar("T")


def shutting_down() -> ShuttingDownError:
    return ShuttingDownError("The server is shutting down; retry on another instance.", headers={"Retry-After": "1"})


class Drain:
    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.started = asyncio.Event()
        self.expired = asyncio.Event()

    def begin(self) -> None:
        """Start draining (on the event loop; see `begin_from_signal`)."""
        if self.started.is_set():
            return
        log.info("shutdown_started", grace_s=self.grace_s)
        self.started.set()
        asyncio.get_running_loop().call_later(self.grace_s, self.expired.set)

    def begin_from_signal(self) -> None:
        """For a signal handler, which interrupts the loop's own thread at an arbitrary point."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop running yet or any more: nothing in flight to drain
        loop.call_soon_threadsafe(self.begin)

    async def guard(self, work: Awaitable[T], admitted: Callable[[], bool], on_abandoned: Callable[[T], None]) -> T:
        """Await `work`; when draining starts, cancel it unless the engine admitted it already, and when the
        grace ends, cancel it anyway. A result that was produced anyway goes to `on_abandoned`."""

        async def until_stopped() -> None:
            await self.started.wait()
            if admitted():
                await self.expired.wait()

        return await cancel_when(work, until_stopped(), on_abandoned, shutting_down)

    async def stream(self, body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """Pass an SSE body through; when the grace ends, stop its generation and end it with an error event
        and [DONE]."""
        chunks = body.__aiter__()
        expired = asyncio.ensure_future(self.expired.wait())
        step: asyncio.Future | None = None
        try:
            while True:
                step = asyncio.ensure_future(chunks.__anext__())
                await asyncio.wait({step, expired}, return_when=asyncio.FIRST_COMPLETED)
                if not step.done():
                    await _cancel(step)  # the body's own `finally` stops the generation
                    yield sse_event(shutting_down().body())
                    yield DONE
                    return
                try:
                    chunk = step.result()
                except StopAsyncIteration:
                    return
                yield chunk
        finally:
            # Also reached when the client leaves (this generator is closed or cancelled mid-step).
            expired.cancel()
            if step is not None and not step.done():
                await _cancel(step)
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()


async def _cancel(step: asyncio.Future) -> None:
    step.cancel()
    with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration, Exception):
        await step


class DrainGate:
    """ASGI layer: once draining, every new request is answered 503 at once and its connection closed."""

    def __init__(self, app: Any, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.drain.started.is_set():
            await self.app(scope, receive, send)
            return
        error = shutting_down()
        error.headers["Connection"] = "close"
        await send_error(send, error)
