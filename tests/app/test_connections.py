"""The request-head limit (`server.connections.max_header_bytes`) on the real uvicorn protocol, fed bytes as a
socket's reads would bring them (one `data_received` per read, so where a read ends is exact): chunked
trailers count against it, pipelined small requests never add up to a false 431, and requests ahead of a 431
on the same connection are answered first.

The app behind it is a few lines of ASGI (this tests the protocol layer; the limit on the real server over
loopback: tests/e2e/test_process_faults.py)."""

from __future__ import annotations

import asyncio
import re

import uvicorn
from uvicorn.server import ServerState

from deltafin.app.connections import guarded_http
from deltafin.config.schema import ConnectionsConfig

LIMIT = 4096


class Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.closed = False
        self.eof = False
        self.reading = True

    def get_extra_info(self, name, default=None):
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(name, default)

    def write(self, data) -> None:
        assert not self.eof, "written after write_eof"
        self.written += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0

    def responses(self) -> list[bytes]:
        """The status lines written, in order."""
        return re.findall(rb"HTTP/1\.1 \d{3} [^\r]*", bytes(self.written))


async def app(scope, receive, send):
    """Reads the whole body; answers 200 with its length and the path, after `release` when the path asks."""
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"] == "/slow":
        await RELEASE.wait()
    seen.append((scope["path"], len(body), [name for name, _ in scope["headers"]]))
    answer = f"{scope['path']} {len(body)}".encode()
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(answer)).encode())]}
    )
    await send({"type": "http.response.body", "body": answer})


RELEASE: asyncio.Event
seen: list = []


async def connection(max_header_bytes: int = LIMIT):
    global RELEASE
    RELEASE = asyncio.Event()
    seen.clear()
    config = uvicorn.Config(app, log_config=None, lifespan="off")
    config.load()
    protocol_class = guarded_http(ConnectionsConfig(max_header_bytes=max_header_bytes))
    protocol = protocol_class(config=config, server_state=ServerState(), app_state={})
    transport = Transport()
    protocol.connection_made(transport)
    return protocol, transport


async def settle() -> None:
    for _ in range(50):
        await asyncio.sleep(0)


def get(path: str, pad: int = 0) -> bytes:
    padding = b"x-pad: " + b"p" * pad + b"\r\n" if pad else b""
    return b"GET " + path.encode() + b" HTTP/1.1\r\nhost: x\r\n" + padding + b"\r\n"


def chunked(path: str, trailer: bytes) -> bytes:
    return (
        b"POST "
        + path.encode()
        + b" HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n"
        + trailer
    )


def run(scenario):
    return asyncio.run(scenario())


class TestTrailers:
    def test_trailers_over_the_limit_in_one_read_are_431(self):
        async def scenario():
            protocol, transport = await connection()
            trailer = b"".join(b"x-t%d: %s\r\n" % (i, b"v" * 100) for i in range(60)) + b"\r\n"  # ~6.6 KiB
            protocol.data_received(chunked("/upload", trailer))
            await settle()
            return transport

        transport = run(scenario)
        assert transport.responses() == [b"HTTP/1.1 431 Request Header Fields Too Large"] and transport.eof
        assert seen == []  # the app was told the client left; it answered nothing

    def test_an_endless_trailer_is_refused_while_it_arrives(self):
        """Before, httptools buffered it whole (32 connections held 748 MiB in 10.5 s), before any key check."""

        async def scenario():
            protocol, transport = await connection()
            protocol.data_received(chunked("/upload", b"x-endless: "))
            reads = 0
            while not transport.responses() and reads < 1000:
                protocol.data_received(b"a" * 1024)
                reads += 1
            await settle()
            return transport, reads

        transport, reads = run(scenario)
        assert transport.responses() == [b"HTTP/1.1 431 Request Header Fields Too Large"]
        assert reads <= LIMIT // 1024 + 2  # the limit plus a read or two, not the whole trailer

    def test_small_trailers_pass_and_never_reach_the_apps_headers(self):
        async def scenario():
            protocol, transport = await connection()
            protocol.data_received(chunked("/upload", b"x-checksum: abc\r\n\r\n"))
            await settle()
            return transport

        transport = run(scenario)
        assert transport.responses() == [b"HTTP/1.1 200 OK"]
        assert seen == [("/upload", 5, [b"host", b"transfer-encoding"])]  # trailers are not request headers

    def test_a_data_chunk_whose_header_ends_a_read_is_not_a_trailer(self):
        async def scenario():
            protocol, transport = await connection()
            head = b"POST /upload HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
            protocol.data_received(head + b"%x\r\n" % (3 * LIMIT))
            for _ in range(3):
                protocol.data_received(b"b" * LIMIT)  # body bytes, each read over the limit
            protocol.data_received(b"\r\n0\r\n\r\n")
            await settle()
            return transport

        transport = run(scenario)
        assert transport.responses() == [b"HTTP/1.1 200 OK"] and seen[0][:2] == ("/upload", 3 * LIMIT)


class TestPipelining:
    def test_small_requests_pipelined_past_the_limit_in_one_read_are_all_answered(self):
        async def scenario():
            protocol, transport = await connection()
            requests = [get(f"/r{i}", pad=200) for i in range(40)]  # ~9.6 KiB in all, each ~250 bytes
            assert sum(map(len, requests)) > 2 * LIMIT
            protocol.data_received(b"".join(requests) + get("/last", pad=200)[:100])  # the last one unfinished
            await settle()
            protocol.data_received(get("/last", pad=200)[100:])
            for _ in range(50):
                await settle()
            return transport

        transport = run(scenario)
        assert transport.responses() == [b"HTTP/1.1 200 OK"] * 41, transport.responses()

    def test_a_request_ahead_of_a_431_is_answered_first(self):
        async def scenario():
            protocol, transport = await connection()
            protocol.data_received(get("/slow"))  # the app answers it only once released
            await settle()
            protocol.data_received(get("/big", pad=2 * LIMIT))  # pipelined behind it: too large
            await settle()
            before_release = transport.responses()
            RELEASE.set()
            for _ in range(20):
                await settle()
            return transport, before_release

        transport, before_release = run(scenario)
        assert before_release == []  # the 431 waited for the answer ahead of it
        assert transport.responses() == [b"HTTP/1.1 200 OK", b"HTTP/1.1 431 Request Header Fields Too Large"]
        assert transport.eof

    def test_an_unfinished_head_over_the_limit_behind_a_request_is_answered_in_order(self):
        async def scenario():
            protocol, transport = await connection()
            protocol.data_received(get("/slow") + b"GET /big HTTP/1.1\r\nx-big: ")
            for _ in range(8):
                protocol.data_received(b"a" * 1024)
            await settle()
            before_release = transport.responses()
            RELEASE.set()
            for _ in range(20):
                await settle()
            return transport, before_release

        transport, before_release = run(scenario)
        assert before_release == []
        assert transport.responses() == [b"HTTP/1.1 200 OK", b"HTTP/1.1 431 Request Header Fields Too Large"]
