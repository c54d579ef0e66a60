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
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import structlog

from deltafin.app.disconnect import Fire, Stopper, cancel_when
from deltafin.app.errors import send_error
from deltafin.errors import DeltafinError, ShuttingDownError
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
        # Called when draining starts (`stopper`) and when the grace ends (`stopper`, and the streams waiting
        # for their next chunk at that moment, see `stream`).
        self._on_start: set[Callable[[], None]] = set()
        self._on_expiry: set[Callable[[], None]] = set()

    def begin(self) -> None:
        """Start draining (on the event loop; see `begin_from_signal`)."""
        if self.started.is_set():
            return
        log.info("shutdown_started", grace_s=self.grace_s)
        self.started.set()
        for callback in list(self._on_start):
            callback()
        asyncio.get_running_loop().call_later(self.grace_s, self._expire)

    def _expire(self) -> None:
        self.expired.set()
        for callback in list(self._on_expiry):
            callback()

    def begin_from_signal(self) -> None:
        """For a signal handler, which interrupts the loop's own thread at an arbitrary point."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop running yet or any more: nothing in flight to drain
        loop.call_soon_threadsafe(self.begin)

    def stopper(self, admitted: Callable[[], bool]) -> Stopper:
        """A reason to stop a request's work (`cancel_when`): when draining starts, unless the engine admitted it
        already; when the grace ends, in any case."""

        def arm(fire: Fire) -> Callable[[], None]:
            def on_start() -> None:
                if not admitted():
                    fire(shutting_down())

            def on_expiry() -> None:
                fire(shutting_down())

            if self.expired.is_set():
                on_expiry()
            elif self.started.is_set():
                on_start()
            self._on_start.add(on_start)
            self._on_expiry.add(on_expiry)

            def disarm() -> None:
                self._on_start.discard(on_start)
                self._on_expiry.discard(on_expiry)

            return disarm

        return arm

    async def guard(self, work: Awaitable[T], admitted: Callable[[], bool], on_abandoned: Callable[[T], None]) -> T:
        """Await `work` under `stopper(admitted)` alone (the routes also stop it on a disconnect)."""
        return await cancel_when(work, [self.stopper(admitted)], on_abandoned)

    async def stream(
        self, body: AsyncIterator[bytes], ending: Callable[[DeltafinError], bytes] | None = None
    ) -> AsyncIterator[bytes]:
        """Pass an SSE body through; when the grace ends, stop its generation and end it with an error event
        and [DONE] (or what `ending` makes of the error: the route's own stream ends in its own shape)."""
        # The body is awaited in this task, not raced in a task of its own per chunk (that cost a task and an
        # `asyncio.wait` per token): a grace that ends while a chunk is awaited cancels this task, which stops
        # the generation at its await just as cancelling that task did.
        chunks = body.__aiter__()
        task = asyncio.current_task()
        assert task is not None  # an async generator body runs in a task
        waiting = False
        interrupted = False

        def interrupt() -> None:
            nonlocal interrupted
            if waiting and not interrupted:
                interrupted = True
                task.cancel()

        self._on_expiry.add(interrupt)
        begun = False
        try:
            while not self.expired.is_set():
                waiting = begun = True
                try:
                    chunk = await chunks.__anext__()
                except StopAsyncIteration:
                    if not interrupted:
                        return
                except BaseException:
                    if not interrupted:
                        raise  # the client left (or the body failed): not ours to answer
                finally:
                    waiting = False
                if interrupted:
                    task.uncancel()  # the cancellation was ours, consumed here, not the caller's
                    break
                yield chunk
            if not begun:  # the grace ended before the body ran: only its own `finally` stops the generation
                step = asyncio.ensure_future(chunks.__anext__())
                await asyncio.sleep(0)
                await _cancel(step)
            if ending is not None:
                yield ending(shutting_down())
            else:
                yield sse_event(shutting_down().body())
                yield DONE
        finally:
            # Also reached when the client leaves (this generator is closed or cancelled mid-step).
            self._on_expiry.discard(interrupt)
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
        await send_error(send, error, scope)
