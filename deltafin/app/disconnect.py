"""Run a request's work until a reason to stop it arrives (the client disconnects, the server's drain); then
cancel it so the engine is freed at once.

The reasons are `Stopper`s armed around one task for the work: a disconnect needs a task reading `receive`,
a drain only callbacks. (Racing each reason against the work in `asyncio.wait`, one layer per reason, cost
four tasks and two waits per request, a tenth of what the gateway spent on one.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from deltafin.errors import ClientClosedRequest

T = TypeVar("T")

Fire = Callable[[Exception], None]
#: Arms one reason to stop: calls `fire(error)` when it happens, and returns the function that disarms it.
Stopper = Callable[[Fire], Callable[[], None]]


def on_disconnect(receive: Callable[[], Awaitable[dict[str, Any]]]) -> Stopper:
    """Stop when the client disconnects (its request body was read already)."""

    def arm(fire: Fire) -> Callable[[], None]:
        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    fire(ClientClosedRequest("client disconnected"))
                    return

        task = asyncio.ensure_future(watch())

        def disarm() -> None:
            task.cancel()

        return disarm

    return arm


async def cancel_when(work: Awaitable[T], stoppers: Sequence[Stopper], on_abandoned: Callable[[T], None]) -> T:
    """Await `work` unless one of `stoppers` fires first: then cancel the work and raise the stopper's error.
    A result produced anyway (the work finished as it was stopped) goes to `on_abandoned`, so its
    generation is stopped too."""
    task = asyncio.ensure_future(work)
    reasons: list[Exception] = []

    def fire(error: Exception) -> None:
        if not reasons and not task.done():
            reasons.append(error)
            task.cancel()

    disarms = [arm(fire) for arm in stoppers]
    try:
        result = await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if reasons and not (current is not None and current.cancelling()):
            raise reasons[0] from None  # the cancellation was ours: answer with its reason
        task.cancel()  # our caller was cancelled: so is the work
        raise
    finally:
        for disarm in disarms:
            disarm()
    if reasons:
        try:
            on_abandoned(result)
        except Exception:
            pass
        raise reasons[0]
    return result
