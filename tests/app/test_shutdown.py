"""The drain: what in-flight and queued work gets once a stop signal arrives (no model needed)."""

import asyncio
import json

import pytest

from deltafin.app.shutdown import Drain
from deltafin.errors import ShuttingDownError


async def body(n, delay):
    for i in range(n):
        await asyncio.sleep(delay)
        yield f"data: {i}\n\n".encode()
    yield b"data: [DONE]\n\n"


async def collect(stream):
    return [chunk async for chunk in stream]


def test_a_stream_that_ends_within_the_grace_is_untouched():
    async def scenario():
        drain = Drain(grace_s=1.0)
        drain.begin()
        return await collect(drain.stream(body(3, 0.01)))

    assert asyncio.run(scenario()) == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"]


def test_a_stream_past_the_grace_ends_with_an_error_event_and_done():
    closed = []

    async def slow():
        try:
            async for chunk in body(100, 0.05):
                yield chunk
        finally:
            closed.append(True)  # the generation behind it is stopped

    async def scenario():
        drain = Drain(grace_s=0.2)
        drain.begin()
        return await collect(drain.stream(slow()))

    chunks = asyncio.run(scenario())
    assert 1 <= len(chunks) < 20 and closed == [True]
    assert chunks[-1] == b"data: [DONE]\n\n"
    assert json.loads(chunks[-2][6:])["error"]["code"] == "server_shutting_down"


@pytest.mark.parametrize("admitted,expected", [(False, "503 at once"), (True, "503 at the grace")])
def test_guarded_work(admitted, expected):
    async def scenario():
        drain = Drain(grace_s=0.3)
        loop = asyncio.get_running_loop()
        started = loop.time()
        loop.call_later(0.05, drain.begin)
        with pytest.raises(ShuttingDownError):
            await drain.guard(asyncio.sleep(10), admitted=lambda: admitted, on_abandoned=lambda _: None)
        return loop.time() - started

    took = asyncio.run(scenario())
    assert (took > 0.3) if admitted else (took < 0.2), (expected, took)


def test_work_that_finishes_in_time_keeps_its_result():
    async def scenario():
        drain = Drain(grace_s=1.0)
        asyncio.get_running_loop().call_later(0.01, drain.begin)

        async def work():
            await asyncio.sleep(0.05)
            return "done"

        return await drain.guard(work(), admitted=lambda: True, on_abandoned=lambda _: None)

    assert asyncio.run(scenario()) == "done"
