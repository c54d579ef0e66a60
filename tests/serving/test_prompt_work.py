"""The prompt-work lanes, with work that blocks until released: bounds, deadlines, and no head-of-line
blocking of small requests behind large ones."""

import asyncio
import threading
import time

import pytest

from deltafin.errors import EngineBusyError
from deltafin.serving.prompt_work import PromptWork

LARGE = 1000


def lanes(max_large=1):
    return PromptWork(object(), large_body_bytes=LARGE, max_large=max_large, timeout_s=1.0)


def blocking(gate: threading.Event, result="done"):
    def work():
        gate.wait(5)
        return result

    return work


def test_small_work_does_not_wait_behind_large_work():
    async def scenario():
        work, gate = lanes(), threading.Event()
        large = asyncio.ensure_future(work.run(blocking(gate), size=LARGE))
        await asyncio.sleep(0.05)
        small = await asyncio.wait_for(work.run(lambda: "small", size=10), 1.0)
        gate.set()
        return small, await large

    assert asyncio.run(scenario()) == ("small", "done")


def test_large_lane_beyond_its_bound_is_429_at_once():
    async def scenario():
        work, gate = lanes(max_large=1), threading.Event()
        first = asyncio.ensure_future(work.run(blocking(gate), size=LARGE))
        await asyncio.sleep(0.05)
        started = time.monotonic()
        with pytest.raises(EngineBusyError):
            await work.run(lambda: "second", size=LARGE)
        refused_in = time.monotonic() - started
        gate.set()
        await first
        return refused_in

    assert asyncio.run(scenario()) < 0.1


def test_waiting_past_the_deadline_is_429_then_and_the_work_is_skipped():
    ran = []

    async def scenario():
        work, gate = lanes(max_large=2), threading.Event()
        first = asyncio.ensure_future(work.run(blocking(gate), size=LARGE))
        await asyncio.sleep(0.05)
        started = time.monotonic()
        with pytest.raises(EngineBusyError):
            await work.run(lambda: ran.append(True), size=LARGE, deadline=time.monotonic() + 0.3)
        refused_in = time.monotonic() - started
        gate.set()
        await first
        await asyncio.sleep(0.1)
        return refused_in

    refused_in = asyncio.run(scenario())
    assert 0.25 < refused_in < 0.6 and ran == []


def test_work_that_started_in_time_is_not_cut_short():
    async def scenario():
        work = lanes()

        def slow():
            time.sleep(0.4)
            return "finished"

        return await work.run(slow, size=10, deadline=time.monotonic() + 0.1)

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
