"""Admission in front of every engine: `capacity` rows run at once, a bounded queue of waiters, a deadline.

A request takes as many units as it has choices (rows), at most the whole capacity. Rows go strictly first come,
first served: a big request at the head is not overtaken for rows by smaller ones behind it. Past `max_waiting`
waiters, or when the deadline passes first, the answer is 429 with Retry-After.

Admission by tokens (as vLLM's scheduler bounds long partial prefills, `max_long_partial_prefills`): a request
whose prompt has `long_prefill_tokens` or more is a long prefill, and at most `max_long_prefills` of them are in
prefill at once, always leaving a row for other requests. One waiting for that turn holds no row, and a shorter
request behind it may pass it, so short requests still start while long prompts prefill (without it, six 6k-token
prompts held every row through their prefill and every newcomer got 429 for 150 s). The front tells admission
when a long request's prefill is over (`prefill_ended`: its first event), and it keeps its rows until it ends.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass, field

from deltafin.errors import EngineBusyError


@dataclass(eq=False)
class _Waiter:
    units: int
    long: bool
    future: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Admission:
    def __init__(
        self,
        *,
        capacity: int = 1,
        max_waiting: int,
        timeout_s: float,
        long_prefill_tokens: int | None = None,
        max_long_prefills: int = 1,
    ) -> None:
        self.capacity = max(1, capacity)
        self.timeout_s = timeout_s
        self._max_waiting = max_waiting
        self._in_use = 0
        self._waiters: deque[_Waiter] = deque()
        #: prompts this long or longer are long prefills (None: no request is)
        self.long_prefill_tokens = long_prefill_tokens
        #: long prefills at once: as configured, but always a row fewer than the capacity (at least one)
        self.max_long_prefills = max(1, min(max_long_prefills, self.capacity - 1))
        self._long_in_prefill = 0

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @property
    def in_use(self) -> int:
        return self._in_use

    @property
    def busy(self) -> bool:
        return self._in_use > 0

    @property
    def long_in_prefill(self) -> int:
        return self._long_in_prefill

    def _busy_error(self, why: str) -> EngineBusyError:
        retry_after = str(max(1, math.ceil(self.timeout_s)))
        return EngineBusyError(
            f"The engine is busy ({why}); retry after {retry_after} s.", headers={"Retry-After": retry_after}
        )

    def units(self, rows: int) -> int:
        return min(max(1, rows), self.capacity)

    def is_long(self, prompt_tokens: int) -> bool:
        return self.long_prefill_tokens is not None and prompt_tokens >= self.long_prefill_tokens

    async def acquire(self, rows: int = 1, *, deadline: float | None = None, prompt_tokens: int = 0) -> int:
        """Wait for `rows` units (capped at the capacity), and for a long prefill's turn when `prompt_tokens` make
        it one; returns the units taken, to give to `release` (and a long one calls `prefill_ended` once its
        prefill is over). `deadline` is a `time.monotonic()` instant (default: now + timeout_s). A cancelled
        waiter (client gone) leaves the queue at once."""
        waiter = _Waiter(self.units(rows), self.is_long(prompt_tokens))
        self._waiters.append(waiter)
        self._wake()
        if waiter.future.done():
            return waiter.units
        if len(self._waiters) > self._max_waiting:
            self._waiters.remove(waiter)
            waiter.future.cancel()
            raise self._busy_error(f"{len(self._waiters)} requests already waiting")
        if deadline is None:
            deadline = time.monotonic() + self.timeout_s
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), timeout=max(0.0, deadline - time.monotonic()))
        except (TimeoutError, asyncio.CancelledError) as exc:
            if waiter.future.done() and not waiter.future.cancelled():
                # Granted in the same instant it gave up: hand the units (and its prefill turn) on.
                self.release(waiter.units)
                if waiter.long:
                    self.prefill_ended()
            else:
                waiter.future.cancel()
                self._waiters.remove(waiter)
                self._wake()  # the head may have been what blocked smaller waiters
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise self._busy_error(f"no turn within {self.timeout_s:g} s") from None
        return waiter.units

    def release(self, units: int = 1) -> None:
        self._in_use -= units
        self._wake()

    def prefill_ended(self) -> None:
        """A long request's prefill is over: the next long prompt may start its own."""
        self._long_in_prefill -= 1
        self._wake()

    def _wake(self) -> None:
        for waiter in list(self._waiters):
            if waiter.future.done():  # cancelled: its requester left
                self._waiters.remove(waiter)
                continue
            if self._in_use + waiter.units > self.capacity:
                break  # rows go first come, first served: nobody behind passes a request short of rows
            if waiter.long and self._long_in_prefill >= self.max_long_prefills:
                continue  # waits for a long prefill's turn, holding no row: shorter requests may pass it
            self._waiters.remove(waiter)
            self._in_use += waiter.units
            self._long_in_prefill += waiter.long
            waiter.future.set_result(None)
