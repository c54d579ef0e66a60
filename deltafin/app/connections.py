"""Slow and excess clients. uvicorn reads headers and bodies with no deadline and takes any number of
connections, so one client sending a byte a second (slowloris), or declaring 1 MB and sending 1 KB, holds a
connection forever. Here:

- `BodyDeadline` (ASGI): the whole body must arrive within `body_timeout_s` of the headers; else 408 JSON and
  the connection is closed;
- `guarded_http(limits)` (uvicorn protocol): a request line and headers must arrive within
  `header_timeout_s` (from the connection, or from the first byte of a keep-alive request), else 408 and
  close; they may be at most `max_header_bytes` long, else 431 and close, decided while they arrive (httptools
  keeps an unfinished header in memory, so a client could otherwise park megabytes per connection). The
  trailer of a chunked body counts against the same limit (with the head), and its fields never join the
  request's headers. A 431 behind pipelined requests waits until they are answered. Beyond `max_open`
  connections a new one is answered 503 JSON and closed at once. (The h11 fallback has its own head limit,
  uvicorn's 16 KiB, answered 400.)
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from uvicorn.protocols.http.h11_impl import H11Protocol

try:  # httptools parses and frames in C: several times less CPU per streamed chunk than h11 (a pyproject dependency)
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _BaseProtocol
except ImportError:  # pragma: no cover - an install without it falls back to pure-Python h11
    _BaseProtocol = H11Protocol  # type: ignore[assignment,misc]  # the pure-Python fallback: the same protocol interface, another class

from deltafin.config.schema import ConnectionsConfig
from deltafin.errors import DeltafinError, EngineUnavailableError, HeadersTooLargeError, RequestTimeoutError


class BodyDeadline:
    def __init__(self, app: Any, timeout_s: float) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        complete = False

        async def bounded_receive() -> dict[str, Any]:
            nonlocal complete
            if complete:  # the body is in; later receives wait for a disconnect and must not time out
                return await receive()
            try:
                # asyncio.timeout, not wait_for: wait_for wraps the receive in a task of its own, per receive.
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise RequestTimeoutError(
                    f"The request body did not arrive within {self.timeout_s:g} s.", headers={"Connection": "close"}
                ) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                complete = True
            return message

        await self.app(scope, bounded_receive, send)


#: how long a connection refused for its headers keeps reading (and dropping) before it closes
_LINGER_S = 2.0

_REASONS = {408: "Request Timeout", 431: "Request Header Fields Too Large", 503: "Service Unavailable"}


def _raw_response(err: DeltafinError) -> bytes:
    body = msgspec.json.encode(err.body())
    head = (
        f"HTTP/1.1 {err.status} {_REASONS[err.status]}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def head_bytes(url: bytes, headers: list[tuple[bytes, bytes]]) -> int:
    """The size of a request's head as sent, near enough: request line and `name: value\r\n` per header."""
    return len(url) + 16 + sum(len(name) + len(value) + 4 for name, value in headers)


def guarded_http(limits: ConnectionsConfig, base: type = _BaseProtocol) -> type:
    """uvicorn's HTTP/1.1 protocol (httptools, else h11) with a header deadline, a header size cap and a cap
    on open connections."""
    # Plain numbers: `limits` may be an omegaconf node, ~20 us a read, and these are read per connection.
    header_timeout_s = float(limits.header_timeout_s)
    max_open = int(limits.max_open)
    max_header_bytes = int(limits.max_header_bytes)

    class GuardedProtocol(base):
        _header_timer: asyncio.TimerHandle | None = None
        # Bytes of the current request's unfinished head known to have arrived; None between heads.
        _head_received: int | None = None
        _head_size = 0  # the current request's whole head, once complete
        # A chunk header was read and no data followed it yet: it may be the last chunk, whose trailer fields
        # follow. Bytes known to be trailer bytes so far (whole reads inside the trailer), and the fields' own.
        _trailer_open = False
        _trailer_received = 0
        _trailer_fields = 0
        _trailing = False  # the current request's head is complete: a header field now is a trailer field
        _events = 0  # parser events that begin or end a part of a message (a read without any lies in one part)
        _unanswered = 0  # requests handed to the app and not answered yet
        _refused = False
        _refusal: bytes | None = None  # a 431 waiting for the requests ahead of it to be answered
        _linger: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_open:
                self._refuse(
                    EngineUnavailableError("Too many open connections; retry later.", code="too_many_connections")
                )
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return  # the 431 is on its way and the connection closing: nothing more is parsed
            if self._awaiting_headers():
                self._arm()
            events, head_open, trailer_open = self._events, self._head_received is not None, self._trailer_open
            super().data_received(data)
            if not self._awaiting_headers():
                self._disarm()
            if self._refused or self._events != events:
                return
            # Nothing began or ended in this read, so all of it lies in the part that was open before it: a head or
            # a trailer, counted per read, before httptools buffers the next one (an endless head or trailer costs
            # the limit plus a read or two). Reads where a head began or ended are not counted: requests pipelined
            # into one read never add up to a false 431 (the whole head is measured exactly when it ends).
            if head_open and self._head_received is not None:
                self._head_received += len(data)
                if self._head_received > max_header_bytes:
                    self._headers_too_large()
            elif trailer_open and self._trailer_open:
                self._trailer_received += len(data)
                if self._head_size + self._trailer_received > max_header_bytes:
                    self._headers_too_large(trailer=True)

        # httptools callbacks: where a request's head, its chunks and its trailer begin and end.
        def on_message_begin(self) -> None:
            self._events += 1
            super().on_message_begin()
            self._head_received = 0
            self._trailing = self._trailer_open = False
            self._trailer_received = self._trailer_fields = 0

        def on_header(self, name: bytes, value: bytes) -> None:
            if not self._trailing:
                super().on_header(name, value)
                return
            # A trailer field of a chunked body: it counts against the head's limit, and is not a request header
            # (ASGI has no request trailers; uvicorn would append it to headers the app may have read already).
            self._trailer_fields += len(name) + len(value) + 4
            if not self._refused and self._head_size + self._trailer_fields > max_header_bytes:
                self._headers_too_large(trailer=True)

        def on_headers_complete(self) -> None:
            self._events += 1
            self._head_received = None
            self._trailing = True
            if self._refused:
                return
            self._head_size = head_bytes(self.url, self.headers)
            if self._head_size > max_header_bytes:
                self._headers_too_large()  # a whole head that came in one read: no request is started
                return
            before = self.cycle
            super().on_headers_complete()
            if self.cycle is not before:
                self._unanswered += 1

        def on_body(self, body: bytes) -> None:
            self._events += 1
            self._trailer_open = False
            if not self._refused:
                super().on_body(body)

        def on_chunk_header(self) -> None:
            self._events += 1
            self._trailer_open = True  # until data follows: the last chunk has none, its trailer comes next

        def on_chunk_complete(self) -> None:
            self._events += 1
            self._trailer_open = False

        def on_message_complete(self) -> None:
            self._events += 1
            self._trailer_open = False
            if not self._refused:
                super().on_message_complete()

        def on_response_complete(self) -> None:
            self._unanswered -= 1
            super().on_response_complete()
            if self._refusal is not None and self._unanswered <= 0:
                self._send_refusal()

        def _headers_too_large(self, *, trailer: bool = False) -> None:
            """431 for the current request: its head, or (`trailer`) the trailer of its chunked body."""
            self._refused = True
            self._disarm()
            err = HeadersTooLargeError(
                f"The request line and headers are larger than {max_header_bytes} bytes "
                "(server.connections.max_header_bytes)."
            )
            cycle = self.cycle
            if trailer and cycle is not None:  # the request was handed to the app when its head was complete
                if cycle.response_started:  # it answered without reading its whole body: that answer stands
                    cycle.keep_alive = False  # and the connection ends after it
                    if cycle.response_complete:
                        self._close_lingering()
                    return
                self._unanswered -= 1  # its answer is the 431
                cycle.disconnected = True  # the app sees the client gone; what it sends is dropped
                cycle.message_event.set()
            self._refusal = _raw_response(err)
            if self._unanswered <= 0:
                self._send_refusal()
            # else: written once the requests ahead of it on this connection are answered (on_response_complete)

        def _send_refusal(self) -> None:
            refusal, self._refusal = self._refusal, None
            if refusal is None or self.transport.is_closing():
                return
            self.transport.write(refusal)
            self._close_lingering()

        def _close_lingering(self) -> None:
            """A lingering close, as nginx does: stop sending, drop whatever the client still sends for a moment
            (data_received), then close. Closing at once would make the kernel answer the unread bytes with a
            reset, which can destroy the 431 before the client reads it."""
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self._linger = self.loop.call_later(_LINGER_S, self.transport.close)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._linger is not None:
                self._linger.cancel()
            super().connection_lost(exc)

        def _awaiting_headers(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout_s, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self._awaiting_headers() and not self.transport.is_closing():
                self._refuse(RequestTimeoutError(f"The request headers did not arrive within {header_timeout_s:g} s."))

        def _refuse(self, err: DeltafinError) -> None:
            self.transport.write(_raw_response(err))
            self.transport.close()

    return GuardedProtocol
