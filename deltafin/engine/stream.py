"""The consumer side of one request's generation: an async iterator of engine events.

Engines emit from any thread (the local engine's worker, an asyncio task of an upstream adapter); events
reach the consumer in order on the event loop. `end()` runs the finishers (admission release) on the loop
before the consumer can see the end, so "done" always means "capacity free".
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import structlog

from deltafin.engine.events import Event
from deltafin.engine.timeline import Timeline
from deltafin.errors import DeltafinError, InternalError

_END = object()


class GenerationFailed(Exception):
    """Carried to the consumer when the engine failed; the cause is logged by the engine, not sent."""

    def __init__(self, error: DeltafinError | str) -> None:
        super().__init__(str(error))
        self.error = error


class CancelFlag:
    """Set once, when the consumer stops; read from any thread (the local engine polls it between steps).
    `on_set` callbacks run on the thread that sets it, and may run twice if set races with registration, so
    they must be idempotent. (A threading.Event would bring a Condition and a lock for a `wait()` nobody makes.)"""

    __slots__ = ("_set", "_callbacks")

    def __init__(self) -> None:
        self._set = False
        self._callbacks: list[Callable[[], None]] = []

    def set(self) -> None:
        if self._set:
            return
        self._set = True  # one store, atomic under the GIL, before any callback runs
        for callback in self._callbacks:
            callback()

    def is_set(self) -> bool:
        return self._set

    def on_set(self, callback: Callable[[], None]) -> None:
        self._callbacks.append(callback)
        if self._set:
            callback()


class GenerationStream:
    def __init__(
        self, loop: asyncio.AbstractEventLoop, *, queue_wait: float = 0.0, timeline: Timeline | None = None
    ) -> None:
        self.loop = loop
        #: the request's trace marks when it is traced (deltafin.engine.timeline), else None
        self._loop_thread = threading.get_ident()  # created on the loop's thread
        self.timeline = timeline
        self.queue_wait = queue_wait
        self.cancelled = CancelFlag()
        # The request's log context (request id ...), for log lines the engine writes on its own threads.
        self.log_context: dict[str, Any] = structlog.contextvars.get_contextvars()
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._observers: list[Callable[[Event], None]] = []
        self._finishers: list[Callable[[], None]] = []
        self._ended = False

    def observe(self, observer: Callable[[Event], None]) -> None:
        """Call `observer(event)` for every event, on the emitting thread (the memo records this way)."""
        self._observers.append(observer)

    def on_end(self, finisher: Callable[[], None]) -> None:
        """Run `finisher()` on the loop when the engine ends the stream, before the consumer sees the end."""
        self._finishers.append(finisher)

    def emit(self, event: Event) -> None:
        for observer in self._observers:
            observer(event)
        self._put(event)

    def end(self) -> None:
        self._put(_END)

    def fail(self, error: DeltafinError | str) -> None:
        """The engine cannot go on: the consumer raises `error` (a DeltafinError keeps its status)."""
        self._put(GenerationFailed(error))
        self._put(_END)

    def has_events(self) -> bool:
        """Whether an event is waiting for the consumer (an upstream's first one, which `started` waited for)."""
        return not self._queue.empty()

    def close(self) -> None:
        """Stop generating at the next token. Synchronous, so it is safe inside a cancelled task."""
        self.cancelled.set()

    def _put(self, item: object) -> None:
        if threading.get_ident() == self._loop_thread:
            self._deliver(item)  # no cross-thread wake-up needed
            return
        try:
            self.loop.call_soon_threadsafe(self._deliver, item)
        except RuntimeError:  # the loop is gone (shutdown): nobody is listening any more
            self.cancelled.set()

    def _deliver(self, item: object) -> None:
        if item is _END:
            if self._ended:
                return
            self._ended = True
            for finisher in self._finishers:
                finisher()
        self._queue.put_nowait(item)

    async def __aiter__(self) -> AsyncIterator[Event]:
        try:
            while True:
                item = await self._queue.get()
                if item is _END:
                    return
                if isinstance(item, GenerationFailed):
                    if isinstance(item.error, DeltafinError):
                        raise item.error
                    raise InternalError("The engine failed while generating; see the server log.")
                yield item
        finally:
            self.close()
