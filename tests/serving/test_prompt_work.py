"""The prompt-work lanes, with work that blocks until released: bounds, deadlines, and no head-of-line
blocking of small requests behind large ones.

Assertions are on the order of events (which work was still blocked when another finished or was refused),
not on how long things took, so a loaded machine cannot fail them; a blocked work gives up after 5 s, so a
regression fails instead of hanging."""

import asyncio
import threading
import time

import pytest

from deltafin.errors import EngineBusyError
from deltafin.serving.prompt_work import PromptWork

LARGE = 1000


def lanes(max_large=1):
    return PromptWork(object(), large_body_bytes=LARGE, max_large=max_large, timeout_s=1.0)


def blocking(gate: threading.Event, result="done", started: threading.Event | None = None):
    def work():
        if started is not None:
            started.set()
        gate.wait(5)
        return result

    return work


async def until(event: threading.Event) -> None:
    """Wait, without blocking the loop, for an event set on a lane's thread."""
    while not event.is_set():
        await asyncio.sleep(0.001)


def test_small_work_does_not_wait_behind_large_work():
    async def scenario():
        work, gate, started = lanes(), threading.Event(), threading.Event()
        large = asyncio.ensure_future(work.run(blocking(gate, started=started), size=LARGE))
        await until(started)
        small = await work.run(lambda: "small", size=10)
        large_was_blocked = not large.done()  # small work behind it would have waited for the gate
        gate.set()
        return small, large_was_blocked, await large

    assert asyncio.run(scenario()) == ("small", True, "done")


def test_large_lane_beyond_its_bound_is_429_at_once():
    async def scenario():
        work, gate, started = lanes(max_large=1), threading.Event(), threading.Event()
        first = asyncio.ensure_future(work.run(blocking(gate, started=started), size=LARGE))
        await until(started)
        with pytest.raises(EngineBusyError):
            await work.run(lambda: "second", size=LARGE)  # no deadline: only the bound can refuse it
        first_was_blocked = not first.done()  # refused at once, not when the lane freed
        gate.set()
        return first_was_blocked, await first

    assert asyncio.run(scenario()) == (True, "done")


def test_waiting_past_the_deadline_is_429_then_and_the_work_is_skipped():
    ran = []

    async def scenario():
        work, gate, started = lanes(max_large=2), threading.Event(), threading.Event()
        first = asyncio.ensure_future(work.run(blocking(gate, started=started), size=LARGE))
        await until(started)
        deadline = time.monotonic() + 0.3
        with pytest.raises(EngineBusyError):
            await work.run(lambda: ran.append(True), size=LARGE, deadline=deadline)
        # Refused when the deadline came (asyncio's timers may fire within its clock's resolution of it) ...
        refused_at_the_deadline = time.monotonic() >= deadline - 1e-3
        first_was_blocked = not first.done()  # ... while the lane was still busy, not when it freed
        gate.set()
        await first
        # The lane runs in order: once this has run, the refused work had its turn (and was skipped).
        after = await work.run(lambda: "after", size=LARGE)
        return refused_at_the_deadline, first_was_blocked, after

    assert asyncio.run(scenario()) == (True, True, "after")
    assert ran == []


def test_work_that_started_in_time_is_not_cut_short():
    async def scenario():
        work = lanes()
        await work.run(lambda: None, size=10)  # the lane's thread exists and idles: the work below starts at once
        deadline = time.monotonic() + 0.5

        def outlives_its_deadline():
            while time.monotonic() <= deadline + 0.05:
                time.sleep(0.01)
            return "finished"

        return await work.run(outlives_its_deadline, size=10, deadline=deadline)

    assert asyncio.run(scenario()) == "finished"


def test_a_caller_that_leaves_while_queued_has_its_work_skipped():
    ran = []

    async def scenario():
        work, gate = lanes(), threading.Event()
        first = asyncio.ensure_future(work.run(blocking(gate), size=10))
        await asyncio.sleep(0.05)
        queued = asyncio.ensure_future(work.run(lambda: ran.append(True), size=10, deadline=time.monotonic() + 5))
        await asyncio.sleep(0.05)
        queued.cancel()  # the client disconnected while its prompt waited for the lane
        with pytest.raises(asyncio.CancelledError):
            await queued
        gate.set()
        assert await first == "done"
        # The lane is free again and the abandoned work never ran.
        assert await work.run(lambda: "after", size=10, deadline=time.monotonic() + 5) == "after"

    asyncio.run(scenario())
    assert ran == []


def test_errors_from_the_work_reach_the_caller_with_a_deadline():
    def broken():
        raise ValueError("bad template")

    async def scenario():
        return await lanes().run(broken, size=10, deadline=time.monotonic() + 5)

    with pytest.raises(ValueError, match="bad template"):
        asyncio.run(scenario())


def inline_lanes(inline_body_bytes=100):
    return PromptWork(object(), large_body_bytes=LARGE, max_large=1, timeout_s=1.0, inline_body_bytes=inline_body_bytes)


def test_a_small_body_is_worked_on_the_loop_itself():
    async def scenario():
        work = inline_lanes()
        return await work.run(threading.get_ident, size=10, deadline=time.monotonic() + 1), threading.get_ident()

    ran_on, loop_thread = asyncio.run(scenario())
    assert ran_on == loop_thread


@pytest.mark.parametrize("size,inline", [(100, True), (10, False), (None, True)])
def test_larger_bodies_unknown_sizes_and_refused_inlining_go_to_a_prompt_thread(size, inline):
    async def scenario():
        work = inline_lanes(inline_body_bytes=100)
        return await work.run(threading.get_ident, size=size, inline=inline), threading.get_ident()

    ran_on, loop_thread = asyncio.run(scenario())
    assert ran_on != loop_thread


def test_inlining_off_sends_every_body_to_a_thread():
    async def scenario():
        return await inline_lanes(inline_body_bytes=0).run(threading.get_ident, size=0), threading.get_ident()

    ran_on, loop_thread = asyncio.run(scenario())
    assert ran_on != loop_thread
