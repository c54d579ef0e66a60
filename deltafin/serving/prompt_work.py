"""Prompt work (templating, tokenizing) off the event loop, bounded so that admission keeps its promise.

A request is admitted to the engine or refused (429) within `server.queue.timeout_s` of its arrival. Before
that it needs its prompt rendered and tokenized, which for a 4 MB body takes seconds. So:

- a body under `server.queue.inline_body_bytes` (8 KiB) is rendered on the event loop itself, when its caller
  allows it (not a request that brings its own template): a one-line chat renders in ~0.1 ms, less than the
  hop to a thread and back costs, and the loop then never gives the GIL to a prompt thread mid-write;
- two lanes, each one thread: bodies of `server.queue.large_body_bytes` or more go to the large lane, the rest
  to the small one, so a one-line chat never waits behind megabytes of someone else's prompt;
- the large lane holds at most `server.queue.max_large_prompts` requests (queued or running); past that, 429;
- a request whose deadline passes while it waits for a lane is refused then (429), and the work it left
  queued is skipped when its turn comes. Once its own prompt work has started it is not cut short: the
  deadline bounds waiting, and the caller moves the engine's deadline on by the time the work took.

Tokenizers are per thread: encoding flips `split_special_tokens` on the Rust object, so a tokenizer shared
between threads could encode a prompt's content with control tokens live.
"""

from __future__ import annotations

import asyncio
import copy
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from deltafin.errors import EngineBusyError

T = TypeVar("T")


class PerThread:
    """One object per thread, made by `make` on the thread's first use."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make
        self._local = threading.local()

    def get(self) -> Any:
        value = getattr(self._local, "value", None)
        if value is None:
            value = self._local.value = self._make()
        return value


class PerThreadChatFormat:
    """A ChatFormat whose renders use a chat format (and so a tokenizer) of the calling thread's own."""

    def __init__(self, make: Callable[[Any], Any], tokenizers: PerThread) -> None:
        self._formats = PerThread(lambda: make(tokenizers.get()))

    def render(self, *args: Any, **kwargs: Any) -> Any:
        return self._formats.get().render(*args, **kwargs)

    def prepare(self) -> None:
        """Build the calling thread's format (and tokenizer) now rather than on its first request."""
        self._formats.get()


class _Expired(Exception):
    """The request behind a queued piece of work was refused before the work began."""


class PromptWork:
    def __init__(
        self, tokenizer: Any, *, large_body_bytes: int, max_large: int, timeout_s: float, inline_body_bytes: int = 0
    ) -> None:
        self.tokenizers = PerThread(lambda: copy.deepcopy(tokenizer))
        self._inline_body_bytes = inline_body_bytes
        self._makers: tuple[Callable[[], Any], ...] = ()
        self._large_body_bytes = large_body_bytes
        self._max_large = max_large
        self._timeout_s = timeout_s
        self._small = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltafin-prompt")
        self._large = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltafin-prompt-large")
        self._large_held = 0  # queued or running in the large lane

    def prepare(self, *makers: Callable[[], Any]) -> None:
        """Run `makers` on each lane's thread before the first request (tokenizer copies take a moment), and
        wait for them: what loading builds is done when loading ends."""
        self._makers = makers
        made = [
            lane.submit(lambda: [make() for make in (self.tokenizers.get, *makers)])
            for lane in (self._small, self._large)
        ]
        for future in made:
            future.result()

    def prepare_loop_thread(self) -> None:
        """Make the calling thread's (the event loop's) tokenizer, and its chat format where small prompts are
        rendered there, so its first request does not pay for a tokenizer copy."""
        self.tokenizers.get()  # token counts and logprob texts are read on the loop
        if self._inline_body_bytes > 0:
            for make in self._makers:
                make()

    def _busy(self, why: str) -> EngineBusyError:
        retry_after = str(max(1, math.ceil(self._timeout_s)))
        return EngineBusyError(
            f"The server is busy ({why}); retry after {retry_after} s.", headers={"Retry-After": retry_after}
        )

    async def run(
        self, fn: Callable[[], T], *, size: int | None = None, deadline: float | None = None, inline: bool = True
    ) -> T:
        """`fn()` on the lane for a body of `size` bytes (unknown: the small lane); 429 if it cannot start by
        `deadline` (monotonic). A body known to be small enough runs `fn()` here, on the loop, if `inline`."""
        if inline and size is not None and size < self._inline_body_bytes:
            return fn()
        size = size or 0
        large = size >= self._large_body_bytes
        if large and self._large_held >= self._max_large:
            raise self._busy(f"{self._large_held} large prompts already in work")
        loop = asyncio.get_running_loop()
        started = False  # set by the lane's thread; read by the deadline timer on the loop

        def guarded() -> T:
            nonlocal started
            if deadline is not None and time.monotonic() > deadline:
                raise _Expired()
            started = True
            return fn()

        lane = self._large if large else self._small
        future = loop.run_in_executor(lane, guarded)
        if large:
            self._large_held += 1
            future.add_done_callback(self._large_done)
        if deadline is None:
            return await future
        # One timer, not an Event, a task and `asyncio.wait` per request (each prompt is one hop to a thread
        # and back, and in front of an upstream that bookkeeping cost as much as the render): at the deadline,
        # work that has not started is abandoned. The work that loses the race with the timer is skipped
        # (`guarded` checks the clock too) or, having just begun, finishes unheard.
        outcome: asyncio.Future[T] = loop.create_future()

        def expire() -> None:
            if not started and not outcome.done():
                outcome.set_exception(self._busy(f"no prompt thread free within {self._timeout_s:g} s"))

        def finished(done: asyncio.Future) -> None:
            if outcome.done():
                _consume(done)
            elif done.cancelled():
                outcome.cancel()
            elif isinstance(done.exception(), _Expired):
                expire()
            elif (error := done.exception()) is not None:
                outcome.set_exception(error)
            else:
                outcome.set_result(done.result())

        future.add_done_callback(finished)
        timer = loop.call_later(max(0.0, deadline - time.monotonic()), expire)
        try:
            return await outcome
        except asyncio.CancelledError:
            future.cancel()  # the client left: work still queued is dropped
            raise
        finally:
            timer.cancel()

    def _large_done(self, _: asyncio.Future) -> None:
        self._large_held -= 1


def _consume(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()  # mark it retrieved, so asyncio does not log "exception was never retrieved"
