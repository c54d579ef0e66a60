"""Whether the upstream is there, as `/health` reports it in gateway mode.

Two sources keep the answer current:
- traffic: a generation that cannot connect, whose stream breaks or that is answered 502/503/504 marks the
  upstream unavailable at once; a generation it answers 200 marks it available;
- an active probe of the upstream's health endpoint, every `PROBE_EVERY_S` while no traffic has spoken for
  that long (so an idle gateway notices an upstream that died, or came back, within about that time).

`readiness()` answers from that state without waiting for the upstream (a hung upstream must not make the
gateway's own health check hang); only the very first call, with nothing known yet, probes inline.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Awaitable, Callable

import structlog

from deltafin.engine.interface import Readiness

log = structlog.get_logger("deltafin.upstream")

#: an idle gateway probes the upstream this often (a GET of its health endpoint on a kept-alive connection)
PROBE_EVERY_S = 0.5


class UpstreamHealth:
    def __init__(self, probe: Callable[[], Awaitable[Readiness]], engine: str) -> None:
        """`probe()` asks the upstream once and says what it found (never raises, bounds its own wait)."""
        self._probe = probe
        self._engine = engine
        self._state: Readiness | None = None
        self._at = 0.0  # monotonic time of the last news, from traffic or a probe
        self._watcher: tuple[asyncio.AbstractEventLoop, asyncio.Task[None]] | None = None
        self._probing: asyncio.Future[Readiness] | None = None

    def available(self) -> None:
        """The upstream just answered a generation."""
        self._set(Readiness(True, "answered a generation"))

    def unavailable(self, detail: str) -> None:
        """The upstream just failed a generation in a way that says it is not there (or not ready)."""
        self._set(Readiness(False, detail))

    async def readiness(self) -> Readiness:
        self._watch()
        if self._state is None:
            return await self._probe_once()
        return self._state

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher[1].cancel()
            self._watcher = None

    def _set(self, state: Readiness) -> None:
        if self._state is None or state.ready != self._state.ready:
            log.info("upstream_health", engine=self._engine, ready=state.ready, detail=state.detail)
        self._state = state
        self._at = time.monotonic()

    def _watch(self) -> None:
        """The idle prober, on the calling loop (started by the first health question, so an engine nobody
        asks about, in tests say, sends nothing of its own to the upstream)."""
        loop = asyncio.get_running_loop()
        if self._watcher is None or self._watcher[0] is not loop or self._watcher[1].done():
            # A context of its own: it outlives the request that started it, whose log fields it must not carry.
            task = loop.create_task(self._probe_when_idle(), context=contextvars.Context())
            self._watcher = (loop, task)

    async def _probe_when_idle(self) -> None:
        while True:
            wait = self._at + PROBE_EVERY_S - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            await self._probe_once()  # news: the next probe is a full period away

    async def _probe_once(self) -> Readiness:
        """One probe at a time; callers that ask meanwhile share its answer."""
        if self._probing is None:
            self._probing = asyncio.ensure_future(self._probe())
            try:
                self._set(await asyncio.shield(self._probing))
            finally:
                self._probing = None
            assert self._state is not None
            return self._state
        return await asyncio.shield(self._probing)
