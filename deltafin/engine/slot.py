"""The single engine slot: one generation at a time, a bounded FIFO of waiters with a timeout."""

from __future__ import annotations

import asyncio
import math

from deltafin.errors import EngineBusyError


class EngineSlot:
    def __init__(self, *, max_waiting: int, timeout_s: float) -> None:
        self._lock = asyncio.Lock()  # asyncio.Lock wakes waiters in FIFO order
        self._max_waiting = max_waiting
        self._timeout_s = timeout_s
        self.waiting = 0

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    def _busy_error(self, why: str) -> EngineBusyError:
        retry_after = str(max(1, math.ceil(self._timeout_s)))
        return EngineBusyError(
            f"The engine is busy ({why}); retry after {retry_after} s.", headers={"Retry-After": retry_after}
        )

    async def acquire(self) -> None:
        """Wait for the engine; a cancelled waiter (client gone) leaves the queue at once."""
        if self._lock.locked() and self.waiting >= self._max_waiting:
            raise self._busy_error(f"{self.waiting} requests already waiting")
        self.waiting += 1
        try:
            await asyncio.wait_for(self._lock.acquire(), timeout=self._timeout_s)
        except asyncio.TimeoutError:
            raise self._busy_error(f"no turn within {self._timeout_s:g} s") from None
        finally:
            self.waiting -= 1

    def release(self) -> None:
        self._lock.release()
