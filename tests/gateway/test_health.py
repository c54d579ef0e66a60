"""Gateway health follows the upstream: at once after a failed generation, by an idle probe otherwise, and the
gateway's own answer never waits on a hung upstream."""

from __future__ import annotations

import asyncio
import time

from deltafin.engine import GenerationJob
from deltafin.engine.upstream import health as health_module
from deltafin.engine.upstream.vllm import VllmAdapter
from deltafin.protocol.sampling import SamplingParams
from deltafin.testing.upstream_fakes import Fake, ScriptedBody, collect, make_front

JOB = GenerationJob((1, 2, 3), SamplingParams(max_tokens=2, temperature=0.0))
ANSWER = [{"choices": [{"index": 0, "token_ids": [5, 6], "finish_reason": "length"}]}]


class Silence(ScriptedBody):
    """An answer that never comes (a hung upstream process holding its port)."""

    def __init__(self) -> None:
        super().__init__([])

    async def write(self, reader, writer) -> bool:
        await asyncio.sleep(3600)
        return False


class Upstream:
    """A fake vLLM whose health and generations can be switched between up, down (503) and hung."""

    def __init__(self) -> None:
        self.state = "up"
        self.fake = Fake(self.answer)

    def answer(self, body: dict, path: str):
        if self.state == "down":
            return 503, {"error": "loading"}
        return (200, {}) if path == "/health" else ScriptedBody(ANSWER)

    @property
    def probes(self) -> int:
        return sum(1 for path, _ in self.fake.requests if path == "/health")


def timed(coro_fn):
    async def run():
        started = time.perf_counter()
        value = await coro_fn()
        return value, time.perf_counter() - started

    return run()


def test_health_follows_generations_at_once(bundle):
    upstream = Upstream()
    front = make_front(VllmAdapter, bundle, upstream.fake)

    async def scenario():
        assert (await front.readiness()).ready
        upstream.state = "down"
        failed = await collect(front, JOB)
        assert failed.start_error is not None and failed.start_error.status == 503
        probes = upstream.probes
        down = await front.readiness()
        # Known from the failed generation itself: no probe sent (so no probe's timeout waited for), no stale "ok".
        assert not down.ready and "503" in down.detail and upstream.probes == probes
        upstream.state = "up"
        assert (await collect(front, JOB)).finished is not None
        assert (await front.readiness()).ready
        await front.aclose()

    asyncio.run(scenario())


def test_an_idle_probe_notices_the_upstream_going_and_coming_back(bundle):
    upstream = Upstream()
    front = make_front(VllmAdapter, bundle, upstream.fake)

    async def scenario():
        assert (await front.readiness()).ready
        upstream.state = "down"
        await asyncio.sleep(health_module.PROBE_EVERY_S * 2.5)  # no traffic, nobody asking
        assert upstream.probes >= 2
        assert not (await front.readiness()).ready
        upstream.state = "up"
        await asyncio.sleep(health_module.PROBE_EVERY_S * 2.5)
        assert (await front.readiness()).ready
        await front.aclose()

    asyncio.run(scenario())


def test_an_unreachable_upstream_is_noticed_by_the_probe(bundle):
    upstream = Upstream()
    front = make_front(VllmAdapter, bundle, upstream.fake)

    async def scenario():
        assert (await front.readiness()).ready
        upstream.fake.refuse = 10**9  # new connections refused, as when the process is gone ...
        front.client.pool.close()  # ... and the kept-alive ones with it
        await asyncio.sleep(health_module.PROBE_EVERY_S * 2.5)
        state = await front.readiness()
        assert not state.ready and "unreachable" in state.detail
        await front.aclose()

    asyncio.run(scenario())


def test_a_hung_upstream_never_makes_the_health_answer_wait(bundle):
    upstream = Upstream()
    front = make_front(VllmAdapter, bundle, upstream.fake)  # connect_timeout_s=1: probes give up after 1 s

    async def scenario():
        assert (await front.readiness()).ready
        upstream.fake.responder = lambda body, path: Silence()
        slowest = 0.0
        for _ in range(15):
            _, took = await timed(front.readiness)
            slowest = max(slowest, took)
            await asyncio.sleep(0.1)
        # Generous: an answer from the kept state takes microseconds; one that waited for the hung probe would take
        # its 1 s connect timeout, so half of that tells the two apart on a loaded machine.
        assert slowest < 0.5
        state = await front.readiness()
        assert not state.ready and "did not answer" in state.detail
        await front.aclose()

    asyncio.run(scenario())
