"""cancel_when: one task for the work, stopped by whichever reason fires first."""

import asyncio

import pytest

from deltafin.app.disconnect import cancel_when, on_disconnect
from deltafin.app.shutdown import Drain
from deltafin.errors import ClientClosedRequest, ShuttingDownError


def receiver(disconnect_after: float | None):
    async def receive():
        if disconnect_after is None:
            await asyncio.sleep(3600)
        await asyncio.sleep(disconnect_after)
        return {"type": "http.disconnect"}

    return receive


async def long_work(cancelled: list):
    """Work that would run 10 s, noting in `cancelled` that it was cancelled."""
    try:
        await asyncio.sleep(10)
    except asyncio.CancelledError:
        cancelled.append(True)
        raise


def test_a_disconnect_cancels_the_work_and_says_why():
    cancelled = []

    async def scenario():
        with pytest.raises(ClientClosedRequest):
            await cancel_when(long_work(cancelled), [on_disconnect(receiver(0.05))], lambda _: None)

    asyncio.run(scenario())
    assert cancelled == [True]


def test_work_that_finishes_first_keeps_its_result_and_leaves_no_watcher():
    async def scenario():
        async def work():
            await asyncio.sleep(0.01)
            return "done"

        result = await cancel_when(work(), [on_disconnect(receiver(None))], lambda _: None)
        await asyncio.sleep(0)
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        return result, others

    result, others = asyncio.run(scenario())
    assert result == "done" and others == []


def test_a_result_produced_as_the_work_is_stopped_is_handed_back_to_be_closed():
    abandoned = []

    async def scenario():
        async def work():
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                return "stream already opened"  # the work swallowed the cancel and produced a result anyway

        with pytest.raises(ClientClosedRequest):
            await cancel_when(work(), [on_disconnect(receiver(0.02))], abandoned.append)

    asyncio.run(scenario())
    assert abandoned == ["stream already opened"]


def test_the_callers_own_cancellation_cancels_the_work_and_stays_a_cancellation():
    cancelled = []

    async def scenario():
        outer = asyncio.ensure_future(
            cancel_when(long_work(cancelled), [on_disconnect(receiver(None))], lambda _: None)
        )
        await asyncio.sleep(0.02)
        outer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await outer

    asyncio.run(scenario())
    assert cancelled == [True]


def test_the_first_reason_wins_when_a_drain_and_a_disconnect_both_come():
    async def scenario():
        drain = Drain(grace_s=5)
        asyncio.get_running_loop().call_later(0.02, drain.begin)
        with pytest.raises(ShuttingDownError):
            await cancel_when(
                asyncio.sleep(10), [on_disconnect(receiver(0.2)), drain.stopper(lambda: False)], lambda _: None
            )
        return drain

    drain = asyncio.run(scenario())
    assert not drain._on_start and not drain._on_expiry  # disarmed: nothing left to call later


def test_a_request_armed_after_draining_began_is_refused_at_once():
    async def scenario():
        drain = Drain(grace_s=5)
        drain.begin()
        began = []

        async def work():
            began.append(True)
            await asyncio.sleep(10)

        with pytest.raises(ShuttingDownError):
            await cancel_when(work(), [drain.stopper(lambda: False)], lambda _: None)
        return began, drain.expired.is_set()

    # at once: the work never began, and the grace had not ended (the other reason to refuse)
    assert asyncio.run(scenario()) == ([], False)
