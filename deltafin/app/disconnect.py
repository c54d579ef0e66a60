"""Run a request's work until the client disconnects; then cancel it so the engine is freed at once."""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, TypeVar

from deltafin.errors import ClientClosedRequest

T = TypeVar("T")



async def _wait_for_disconnect(receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnected(
    receive: Callable[[], Awaitable[dict[str, Any]]], work: Awaitable[T], on_abandoned: Callable[[T], None]
) -> T:
    """Await `work`; if the client goes first, cancel it. A result that was produced anyway (the race of
    both finishing together) is handed to `on_abandoned` so its generation is stopped too."""
    return await cancel_when(work, _wait_for_disconnect(receive), on_abandoned, lambda: ClientClosedRequest("client disconnected"))


async def cancel_when(
    work: Awaitable[T], stop: Awaitable[None], on_abandoned: Callable[[T], None], error: Callable[[], Exception]
) -> T:
    """Await `work` unless `stop` completes first: then cancel the work and raise `error()`. A result
    produced anyway goes to `on_abandoned`."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(stop)
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        on_abandoned(await task)
    except (asyncio.CancelledError, Exception):
        pass
    raise error()
