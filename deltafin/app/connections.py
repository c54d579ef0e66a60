"""Slow and excess clients. uvicorn reads headers and bodies with no deadline and takes any number of
connections, so one client sending a byte a second (slowloris), or declaring 1 MB and sending 1 KB, holds a
connection forever. Here:

- `BodyDeadline` (ASGI): the whole body must arrive within `body_timeout_s` of the headers; else 408 JSON and
  the connection is closed;
- `guarded_http(limits)` (uvicorn protocol): a request line and headers must arrive within
  `header_timeout_s` (from the connection, or from the first byte of a keep-alive request), else 408 and
  close; they may be at most `max_header_bytes` long, else 431 and close, decided while they arrive (httptools
  keeps an unfinished header in memory, so a client could otherwise park megabytes per connection); beyond
  `max_open` connections a new one is answered 503 JSON and closed at once. (The h11 fallback has its
  own head limit, uvicorn's 16 KiB, answered 400.)
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from uvicorn.protocols.http.h11_impl import H11Protocol

try:  # httptools parses and frames in C: several times less CPU per streamed chunk than h11 (a pyproject dependency)
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _BaseProtocol
except ImportError:  # pragma: no cover - an install without it falls back to pure-Python h11
    _BaseProtocol = H11Protocol  # type: ignore[assignment,misc]

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
        # Bytes received since the current request's head began, while it is unfinished; None between heads.
        _head_received: int | None = None
        _refused = False
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
            super().data_received(data)
            if not self._awaiting_headers():
                self._disarm()
            if self._head_received is not None and not self._refused:
                # Still inside a head. Counted per read, before httptools buffers the next one, so an endless
                # header costs at most the limit plus one read (256 KiB). A head that began inside this read
                # is counted from the read's start: too many bytes only when requests were pipelined into it.
                self._head_received += len(data)
                if self._head_received > max_header_bytes:
                    self._headers_too_large()

        # httptools callbacks: where a request's head begins and ends.
        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_received = 0

        def on_headers_complete(self) -> None:
            self._head_received = None
            if self._refused:
                return
            if head_bytes(self.url, self.headers) > max_header_bytes:
                self._headers_too_large()  # a whole head that came in one read: no request is started
                return
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if not self._refused:
                super().on_body(body)

        def on_message_complete(self) -> None:
            if not self._refused:
                super().on_message_complete()

        def _headers_too_large(self) -> None:
            self._refused = True
            self._disarm()
            self.transport.write(
                _raw_response(
                    HeadersTooLargeError(
                        f"The request line and headers are larger than {max_header_bytes} bytes "
                        "(server.connections.max_header_bytes)."
                    )
                )
            )
            # A lingering close, as nginx does: stop sending, drop whatever the client still sends for a moment
            # (data_received), then close. Closing at once would make the kernel answer the unread bytes with a
            # reset, which can destroy the 431 before the client reads it.
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
