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


def test_a_stream_stalled_on_a_chunk_when_draining_begins_is_ended_at_the_grace():
    closed = []

    async def stalled():
        try:
            yield b"data: 0\n\n"
            await asyncio.sleep(60)  # an upstream that never sends the next token
            yield b"data: 1\n\n"
        finally:
            closed.append(True)

    async def scenario():
        drain = Drain(grace_s=0.1)
        asyncio.get_running_loop().call_later(
            0.05, drain.begin
        )  # after the stream began waiting: it must be interrupted
        chunks = await collect(drain.stream(stalled()))
        return chunks, asyncio.current_task().cancelling()

    # Interrupted at the grace's end, not after the upstream's 60 s: its next token never came through.
    chunks, cancelling = asyncio.run(scenario())
    assert chunks[0] == b"data: 0\n\n" and chunks[-1] == b"data: [DONE]\n\n" and len(chunks) == 3
    assert json.loads(chunks[1][6:])["error"]["code"] == "server_shutting_down"
    assert closed == [True] and cancelling == 0  # the drain's own cancellation is not left pending


def test_a_body_not_begun_when_the_grace_ended_is_still_closed():
    closed = []

    async def never_begun():
        try:
            yield b"data: 0\n\n"
        finally:
            closed.append(True)

    async def scenario():
        drain = Drain(grace_s=0.0)
        drain.begin()
        await asyncio.sleep(0.01)
        return await collect(drain.stream(never_begun()))

    chunks = asyncio.run(scenario())
    assert chunks[-1] == b"data: [DONE]\n\n" and closed == [True]


@pytest.mark.parametrize("admitted,expected", [(False, "503 at once"), (True, "503 at the grace")])
def test_guarded_work(admitted, expected):
    async def scenario():
        drain = Drain(grace_s=0.3)
        asyncio.get_running_loop().call_later(0.05, drain.begin)
        with pytest.raises(ShuttingDownError):
            await drain.guard(asyncio.sleep(10), admitted=lambda: admitted, on_abandoned=lambda _: None)
        return drain.started.is_set(), drain.expired.is_set()

    # refused once draining began; an admitted request only once the grace ended as well
    assert asyncio.run(scenario()) == (True, admitted), expected


def test_work_that_finishes_in_time_keeps_its_result():
    async def scenario():
        drain = Drain(grace_s=1.0)
        asyncio.get_running_loop().call_later(0.01, drain.begin)

        async def work():
            await asyncio.sleep(0.05)
            return "done"

        return await drain.guard(work(), admitted=lambda: True, on_abandoned=lambda _: None)

    assert asyncio.run(scenario()) == "done"
