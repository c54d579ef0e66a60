"""Admission in front of every engine: `capacity` rows run at once, a bounded FIFO of waiters, a deadline.

A request takes as many units as it has choices (rows), at most the whole capacity. Waiters are served
strictly first come, first served: a big request at the head is not overtaken by smaller ones behind it.
Past `max_waiting` waiters, or when the deadline passes first, the answer is 429 with Retry-After.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque

from deltafin.errors import EngineBusyError


class Admission:
    def __init__(self, *, capacity: int = 1, max_waiting: int, timeout_s: float) -> None:
        self.capacity = max(1, capacity)
        self.timeout_s = timeout_s
        self._max_waiting = max_waiting
        self._in_use = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @property
    def in_use(self) -> int:
        return self._in_use

    @property
    def busy(self) -> bool:
        return self._in_use > 0

    def _busy_error(self, why: str) -> EngineBusyError:
        retry_after = str(max(1, math.ceil(self.timeout_s)))
        return EngineBusyError(
            f"The engine is busy ({why}); retry after {retry_after} s.", headers={"Retry-After": retry_after}
        )

    def units(self, rows: int) -> int:
        return min(max(1, rows), self.capacity)

    async def acquire(self, rows: int = 1, *, deadline: float | None = None) -> int:
        """Wait for `rows` units (capped at the capacity); returns the units taken, to give to `release`.
        `deadline` is a `time.monotonic()` instant (default: now + timeout_s). A cancelled waiter (client
        gone) leaves the queue at once."""
        units = self.units(rows)
        if not self._waiters and self._in_use + units <= self.capacity:
            self._in_use += units
            return units
        if len(self._waiters) >= self._max_waiting:
            raise self._busy_error(f"{len(self._waiters)} requests already waiting")
        if deadline is None:
            deadline = time.monotonic() + self.timeout_s
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (units, future)
        self._waiters.append(entry)
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout=max(0.0, deadline - time.monotonic()))
        except (TimeoutError, asyncio.CancelledError) as exc:
            if future.done() and not future.cancelled():
                # Granted in the same instant it gave up: hand the units on.
                self.release(units)
            else:
                future.cancel()
                self._waiters.remove(entry)
                self._wake()  # the head may have been what blocked smaller waiters
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise self._busy_error(f"no turn within {self.timeout_s:g} s") from None
        return units

    def release(self, units: int = 1) -> None:
        self._in_use -= units
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self._in_use + self._waiters[0][0] <= self.capacity:
            units, future = self._waiters.popleft()
            if future.cancelled():
                continue
            self._in_use += units
            future.set_result(None)
