"""In-process fakes of the upstream wire protocols: a real HTTP/1.1 server (keep-alive, chunked SSE bodies,
statuses, drops) that the gateway's own HTTP client talks to over real sockets.

`Fake.connector()` hands the engine one end of a socket pair per connection and serves the other end on the
same event loop (no port, no thread); `Fake.serve_tcp()` listens on 127.0.0.1 instead. A fake records every
request, how many connections it was opened, and whether the gateway closed each streamed body early,
which is how the tests see cancellation, early stops and connection reuse reach the upstream.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from deltafin.engine import EngineFront, Finished, GenerationJob, TextDelta
from deltafin.engine.upstream.engine import Adapter, UpstreamEngine, UpstreamSettings
from deltafin.errors import DeltafinError

URL = "http://upstream.test:8000"
#: an event of a ScriptedBody that drops the connection there (a reset mid-stream)
DROP = object()


class ScriptedBody:
    """SSE events, one after the other (`delay` apart), sent as HTTP chunks; `closed_early` is set if the
    reader closed the connection before the end."""

    def __init__(
        self,
        events: Sequence[Any],
        delay: float = 0.0,
        tail: bytes = b"data: [DONE]\n\n",
        *,
        chunks: Callable[[bytes], list[bytes]] | None = None,
    ) -> None:
        self.events = events
        self.delay = delay
        self.tail = tail
        #: how the body bytes are cut into HTTP chunks (default: one chunk per event)
        self.chunks = chunks or (lambda data: [data])
        self.finished = False
        self.closed_early = False

    def encoded(self, event: Any) -> bytes:
        return event if isinstance(event, bytes) else b"data: " + json.dumps(event).encode() + b"\n\n"

    async def write(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Send the whole response; False if the connection must close (dropped, or the client left)."""
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        # The client sends nothing more before the last chunk, so a read that ends now means it closed.
        left = asyncio.ensure_future(reader.read(1))
        try:
            for event in [*self.events, self.tail]:
                if self.delay:
                    await asyncio.wait({left}, timeout=self.delay)
                if left.done():
                    self.closed_early = True
                    return False
                if event is DROP:
                    writer.transport.abort()
                    return False
                for piece in self.chunks(self.encoded(event)):
                    if piece:
                        writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                await writer.drain()
        except ConnectionError:
            self.closed_early = True
            return False
        finally:
            left.cancel()
            await asyncio.wait({left})  # a read still pending would collide with the next request's read
        self.finished = True
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True


@dataclass
class Fake:
    """Answers each request with `responder(request_json, path)`: a ScriptedBody (200 SSE), or
    (status, body[, headers]). The first `refuse` connections are refused (an upstream that is down)."""

    responder: Callable[[dict, str], Any]
    refuse: int = 0
    requests: list[tuple[str, dict]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    bodies: list[ScriptedBody] = field(default_factory=list)
    #: connections opened by the gateway (refused ones not counted)
    connections: int = 0
    _serving: set = field(default_factory=set)

    @classmethod
    def down(cls) -> Fake:
        return cls(lambda body, path: (500, {}), refuse=10**9)

    def connector(self):
        async def connect() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            if self.refuse > 0:
                self.refuse -= 1
                raise ConnectionRefusedError(111, "Connection refused")
            ours, theirs = socket.socketpair()
            reader, writer = await asyncio.open_connection(sock=ours)
            task = asyncio.ensure_future(self._serve(*await asyncio.open_connection(sock=theirs)))
            self._serving.add(task)  # the loop holds tasks weakly
            task.add_done_callback(self._serving.discard)
            return reader, writer

        return connect

    async def serve_tcp(self) -> tuple[asyncio.Server, str]:
        """Listen on a free loopback port (on the running loop); returns (server, base URL)."""
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while await self._one(reader, writer):
                pass
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.transport.abort()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        path = head[0].split(" ")[1]
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:] if line)}
        body = await reader.readexactly(int(headers.get("content-length", 0)))
        payload = json.loads(body or b"{}")
        self.requests.append((path, payload))
        self.headers.append(headers)
        answer = self.responder(payload, path)
        if isinstance(answer, ScriptedBody):
            self.bodies.append(answer)
            return await answer.write(reader, writer)
        status, content, *extra = answer
        data = json.dumps(content).encode()
        fields = "".join(f"{k}: {v}\r\n" for k, v in (extra[0] if extra else {}).items())
        writer.write(
            f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {len(data)}\r\n"
            f"{fields}\r\n".encode()
            + data
        )
        await writer.drain()
        return True


def make_engine(
    adapter_cls: type[Adapter],
    bundle,
    fake: Fake,
    *,
    max_inflight: int = 4,
    url: str = URL,
    read_timeout_s: float = 5.0,
    tcp: bool = False,
    spare_connections: int = 0,
    **adapter_kwargs: Any,
) -> UpstreamEngine:
    """An engine in front of `fake`. No spare connection unless asked for (tests count connections and refusals;
    tests/gateway/test_http1.py::TestSpareConnections covers the spare itself)."""
    settings = UpstreamSettings(
        url=url,
        max_inflight=max_inflight,
        connect_timeout_s=1.0,
        read_timeout_s=read_timeout_s,
        spare_connections=spare_connections,
    )
    return UpstreamEngine(adapter_cls(settings, **adapter_kwargs), bundle, connect=None if tcp else fake.connector())


def make_front(adapter_cls: type[Adapter], bundle, fake: Fake, **kwargs: Any) -> EngineFront:
    return EngineFront(make_engine(adapter_cls, bundle, fake, **kwargs), max_waiting=4, timeout_s=1.0, memo_entries=0)


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
    await asyncio.sleep(0.01)  # and the fake upstream time to see a closed connection
    return out
