import asyncio
import time

import pytest

from deltafin.engine.admission import Admission
from deltafin.errors import EngineBusyError


def run(coro):
    return asyncio.run(coro)


class TestAdmission:
    def test_timeout_gives_429_with_retry_after(self):
        async def scenario():
            slot = Admission(max_waiting=4, timeout_s=0.05)
            await slot.acquire()
            with pytest.raises(EngineBusyError) as info:
                await slot.acquire()
            return info.value

        err = run(scenario())
        assert err.status == 429
        assert err.headers["Retry-After"] == "1"

    def test_full_queue_rejects_at_once(self):
        async def scenario():
            slot = Admission(max_waiting=1, timeout_s=10)
            await slot.acquire()
            waiter = asyncio.ensure_future(slot.acquire())
            await asyncio.sleep(0)
            with pytest.raises(EngineBusyError):
                await slot.acquire()
            # at once: while the waiter ahead still waits (a queued third would time out after it, 10 s on)
            waiter_still_waiting = not waiter.done()
            slot.release()
            await waiter
            return waiter_still_waiting

        assert run(scenario()) is True

    def test_cancelled_waiter_leaves_the_queue(self):
        async def scenario():
            slot = Admission(max_waiting=1, timeout_s=10)
            await slot.acquire()
            waiter = asyncio.ensure_future(slot.acquire())
            await asyncio.sleep(0)
            assert slot.waiting == 1
            waiter.cancel()
            await asyncio.gather(waiter, return_exceptions=True)
            assert slot.waiting == 0
            slot.release()
            await asyncio.wait_for(slot.acquire(), 1)  # the slot is free for the next one

        run(scenario())

    def test_waiters_are_served_in_arrival_order(self):
        async def scenario():
            slot = Admission(max_waiting=8, timeout_s=5)
            order = []
            await slot.acquire()

            async def worker(name):
                await slot.acquire()
                order.append(name)
                slot.release()

            tasks = [asyncio.ensure_future(worker(i)) for i in range(4)]
            await asyncio.sleep(0.01)
            slot.release()
            await asyncio.gather(*tasks)
            return order

        assert run(scenario()) == [0, 1, 2, 3]

    def test_capacity_admits_that_many_rows_at_once(self):
        async def scenario():
            admission = Admission(capacity=4, max_waiting=4, timeout_s=0.05)
            taken = [await admission.acquire(2), await admission.acquire(1), await admission.acquire(1)]
            with pytest.raises(EngineBusyError):
                await admission.acquire(1)
            admission.release(taken[0])
            return taken, await asyncio.wait_for(admission.acquire(2), 1)

        assert run(scenario()) == ([2, 1, 1], 2)

    def test_a_request_wider_than_the_capacity_takes_all_of_it(self):
        async def scenario():
            admission = Admission(capacity=2, max_waiting=4, timeout_s=1)
            return await admission.acquire(8), admission.in_use

        assert run(scenario()) == (2, 2)

    def test_fifo_holds_small_requests_behind_a_big_head(self):
        async def scenario():
            admission = Admission(capacity=2, max_waiting=4, timeout_s=5)
            await admission.acquire(1)
            order = []

            async def worker(name, rows):
                units = await admission.acquire(rows)
                order.append(name)
                return units

            big = asyncio.ensure_future(worker("big", 2))
            await asyncio.sleep(0.01)
            small = asyncio.ensure_future(worker("small", 1))
            await asyncio.sleep(0.01)
            assert order == []  # one unit is free, but the big head waits for two and nobody overtakes it
            admission.release(1)
            admission.release(await big)
            await small
            return order

        assert run(scenario()) == ["big", "small"]

    def test_deadline_bounds_the_wait(self):
        async def scenario():
            admission = Admission(max_waiting=4, timeout_s=30)
            await admission.acquire()
            started = time.monotonic()
            with pytest.raises(EngineBusyError):
                await admission.acquire(deadline=time.monotonic() + 0.05)
            return time.monotonic() - started, admission.waiting

        waited, waiting = run(scenario())
        assert waited < 1 and waiting == 0
