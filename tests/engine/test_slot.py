import asyncio

import pytest

from deltafin.engine.slot import EngineSlot
from deltafin.errors import EngineBusyError


def run(coro):
    return asyncio.run(coro)


class TestEngineSlot:
    def test_timeout_gives_429_with_retry_after(self):
        async def scenario():
            slot = EngineSlot(max_waiting=4, timeout_s=0.05)
            await slot.acquire()
            with pytest.raises(EngineBusyError) as info:
                await slot.acquire()
            return info.value

        err = run(scenario())
        assert err.status == 429
        assert err.headers["Retry-After"] == "1"

    def test_full_queue_rejects_at_once(self):
        async def scenario():
            slot = EngineSlot(max_waiting=1, timeout_s=10)
            await slot.acquire()
            waiter = asyncio.ensure_future(slot.acquire())
            await asyncio.sleep(0)
            started = asyncio.get_running_loop().time()
            with pytest.raises(EngineBusyError):
                await slot.acquire()
            elapsed = asyncio.get_running_loop().time() - started
            slot.release()
            await waiter
            return elapsed

        assert run(scenario()) < 0.5

    def test_cancelled_waiter_leaves_the_queue(self):
        async def scenario():
            slot = EngineSlot(max_waiting=1, timeout_s=10)
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
            slot = EngineSlot(max_waiting=8, timeout_s=5)
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
