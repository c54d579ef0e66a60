"""In-process fakes of the upstream wire protocols (httpx.MockTransport): scripted SSE bodies, statuses, drops.

A fake records every request it received and whether the gateway closed each streamed body early, which is how
the tests see cancellation and early stops reach the upstream.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Sequence

import httpx

from deltafin.engine import EngineFront, Finished, GenerationJob, TextDelta
from deltafin.engine.upstream.engine import Adapter, UpstreamEngine, UpstreamSettings
from deltafin.errors import DeltafinError

URL = "http://upstream.test:8000"


class ScriptedBody(httpx.AsyncByteStream):
    """SSE events, one after the other (`delay` apart); `closed_early` is set if the reader closes before the end."""

    def __init__(self, events: Sequence[Any], delay: float = 0.0, tail: bytes = b"data: [DONE]\n\n") -> None:
        self.events = events
        self.delay = delay
        self.tail = tail
        self.finished = False
        self.closed_early = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for event in self.events:
            if self.delay:
                await asyncio.sleep(self.delay)
            if isinstance(event, Exception):
                raise event
            yield event if isinstance(event, bytes) else b"data: " + json.dumps(event).encode() + b"\n\n"
        yield self.tail
        self.finished = True

    async def aclose(self) -> None:
        if not self.finished:
            self.closed_early = True


@dataclass
class Fake:
    """Answers each request with `responder(request_json, path)`: a ScriptedBody (200 SSE), or (status, body)."""

    responder: Callable[[dict, str], Any]
    requests: list[tuple[str, dict]] = field(default_factory=list)
    bodies: list[ScriptedBody] = field(default_factory=list)

    def transport(self) -> httpx.MockTransport:
        async def handle(request: httpx.Request) -> httpx.Response:
            payload = json.loads(request.content or b"{}")
            path = request.url.path
            self.requests.append((path, payload))
            answer = self.responder(payload, path)
            if isinstance(answer, Exception):
                raise answer
            if isinstance(answer, ScriptedBody):
                self.bodies.append(answer)
                return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=answer)
            status, body, *headers = answer
            return httpx.Response(status, json=body, headers=headers[0] if headers else None)

        return httpx.MockTransport(handle)


def make_front(adapter_cls: type[Adapter], bundle, fake: Fake, *, max_inflight: int = 4, **adapter_kwargs: Any) -> EngineFront:
    settings = UpstreamSettings(url=URL, max_inflight=max_inflight, connect_timeout_s=1.0, read_timeout_s=5.0)
    engine = UpstreamEngine(adapter_cls(settings, **adapter_kwargs), bundle, transport=fake.transport())
    return EngineFront(engine, max_waiting=4, timeout_s=1.0, memo_entries=0)


@dataclass
class Outcome:
    text: str = ""
    ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finished: Finished | None = None
    error: DeltafinError | None = None
    start_error: DeltafinError | None = None


async def collect(front: EngineFront, job: GenerationJob, *, stop_after: int | None = None) -> Outcome:
    """Run one job; `stop_after` closes the stream (a client that leaves) after that many text deltas."""
    out = Outcome()
    try:
        stream = await front.start([job])
    except DeltafinError as exc:
        out.start_error = exc
        return out
    deltas = 0
    try:
        async for event in stream:
            if isinstance(event, TextDelta):
                out.text += event.text
                out.ids += event.token_ids
                out.logprobs += event.logprobs
                deltas += 1
                if stop_after is not None and deltas >= stop_after:
                    stream.close()
                    break
            elif isinstance(event, Finished):
                out.finished = event
    except DeltafinError as exc:
        out.error = exc
    # Give the engine's poll loop time to see a close and end the submission.
    for _ in range(50):
        if front.admission.in_use == 0:
            break
        await asyncio.sleep(0.02)
    return out
