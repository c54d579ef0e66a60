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
        # Generous: the deadline was 0.05 s away and the queue's own timeout 30 s; 10 s tells which one ended the wait.
        assert waited < 10 and waiting == 0


class TestLongPrefills:
    """Admission by tokens: prompts of `long_prefill_tokens` or more prefill at most `max_long_prefills` at a time
    (vLLM's max_long_partial_prefills), and a short request passes long ones waiting for that turn, so it still
    starts while long prompts prefill (six 6k-token prompts held every row and newcomers got 429 for 150 s)."""

    def admission(self, capacity=3, max_long=1, timeout_s=5.0):
        return Admission(
            capacity=capacity, max_waiting=8, timeout_s=timeout_s, long_prefill_tokens=1000, max_long_prefills=max_long
        )

    def test_a_short_request_passes_long_ones_waiting_for_their_prefill(self):
        async def scenario():
            admission = self.admission(capacity=3)
            await admission.acquire(1, prompt_tokens=6000)  # prefilling
            second = asyncio.ensure_future(admission.acquire(1, prompt_tokens=6000))
            third = asyncio.ensure_future(admission.acquire(1, prompt_tokens=6000))
            await asyncio.sleep(0)
            short = await asyncio.wait_for(admission.acquire(1, prompt_tokens=20), 1)
            waiting = (second.done(), third.done())
            admission.prefill_ended()  # the first long prompt's prefill is done (it keeps its row)
            await asyncio.wait_for(second, 1)
            third_after_one = third.done()
            third.cancel()
            return short, waiting, third_after_one, admission.in_use

        short, waiting, third_after_one, in_use = run(scenario())
        assert short == 1 and waiting == (False, False) and not third_after_one and in_use == 3

    def test_a_row_stays_for_short_requests_whatever_the_setting(self):
        async def scenario():
            admission = self.admission(capacity=2, max_long=8)
            await admission.acquire(1, prompt_tokens=6000)
            long_waits = asyncio.ensure_future(admission.acquire(1, prompt_tokens=6000))
            await asyncio.sleep(0)
            short = await asyncio.wait_for(admission.acquire(1, prompt_tokens=5), 1)
            done = long_waits.done()
            long_waits.cancel()
            return short, done

        assert run(scenario()) == (1, False)

    def test_rows_stay_first_come_first_served(self):
        """A short request passes a long one waiting for its prefill turn, never one waiting for rows."""

        async def scenario():
            admission = self.admission(capacity=2)
            await admission.acquire(2, prompt_tokens=10)  # every row taken
            big = asyncio.ensure_future(admission.acquire(2, prompt_tokens=10))
            await asyncio.sleep(0)
            small = asyncio.ensure_future(admission.acquire(1, prompt_tokens=10))
            await asyncio.sleep(0)
            admission.release(1)  # one row: enough for the small one, not for the big one ahead of it
            await asyncio.sleep(0)
            order = (big.done(), small.done())
            admission.release(1)
            await asyncio.wait_for(big, 1)
            small.cancel()
            return order

        assert run(scenario()) == (False, False)

    def test_a_long_waiter_that_leaves_or_times_out_frees_its_turn(self):
        async def scenario():
            admission = self.admission(capacity=3, timeout_s=0.05)
            await admission.acquire(1, prompt_tokens=6000)
            with pytest.raises(EngineBusyError):
                await admission.acquire(1, prompt_tokens=6000)
            admission.prefill_ended()
            return await asyncio.wait_for(admission.acquire(1, prompt_tokens=6000), 1), admission.waiting

        assert run(scenario()) == (1, 0)

    def test_off_when_no_threshold_is_set(self):
        async def scenario():
            admission = Admission(capacity=3, max_waiting=8, timeout_s=1)
            return [await asyncio.wait_for(admission.acquire(1, prompt_tokens=10**6), 1) for _ in range(3)]

        assert run(scenario()) == [1, 1, 1]
