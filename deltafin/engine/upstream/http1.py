"""A small HTTP/1.1 client for the gateway's token path: keep-alive connections to one upstream, and a body
read one network read at a time.

Why not httpx: behind a gateway every generated token is one upstream read, and httpx/httpcore/anyio spend
more CPU per read (a cancel scope and a timeout per read, several layers of async generators) than all of
Deltafin's own per-token work. Here one read is one `StreamReader.read`, chunked framing is undone by
httptools' C parser (`ChunkedDecoder`), and the read timeout is one timer per request, re-armed only when it fires (`_Watchdog`).

The client speaks just what the upstreams answer: a status line, headers, then a chunked, a sized or a
read-to-close body. A connection goes back to the pool only when its response was read to the end and the
server did not ask to close it; any other ending closes it (that is how a stopped choice ends upstream).
"""

from __future__ import annotations

import asyncio
import ssl
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping

import httptools

#: opens one connection to the upstream (tests pass an in-process one); the pool owns what it returns
Connector = Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]

_READ_SIZE = 65536


class TransportError(Exception):
    """The exchange failed below HTTP."""


class ConnectFailed(TransportError):
    """The request never reached the upstream: no connection could be opened (refused, unresolvable, or not within
    the connect timeout), or a new one was closed before a byte of answer (a dying server whose listening socket
    outlives it: vLLM's engine process holds the API server's for a moment after a kill). Most likely never read,
    so it is reported as unavailable (a retryable 503), though a server that died of this very request looks
    the same from here."""


class ReadTimedOut(TransportError):
    """The upstream was silent longer than the read timeout."""


class ConnectionBroken(TransportError):
    """The connection closed or broke mid-exchange, or the framing was not HTTP/1.1."""


class ChunkedDecoder:
    """Undoes `Transfer-Encoding: chunked` incrementally through httptools' C parser (llhttp, uvicorn's): `feed`
    raw bytes, get body bytes; `done` after the last chunk and its trailers. Raises `ConnectionBroken` on framing
    that is not chunked coding. (bench/handwritten.py: 8.7x less CPU an event than the Python decoder it
    replaced.)"""

    _HEAD = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"  # the real head was read by the client

    def __init__(self) -> None:
        self._body: list[bytes] = []
        self.done = False
        #: whether bytes came after the last chunk (a server that pipelines or misframes: not reusable)
        self.extra = False
        self._parser = httptools.HttpResponseParser(self)
        self._parser.feed_data(self._HEAD)

    def feed(self, data: bytes) -> bytes:
        if self.extra:
            return b""
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if not self.done:
                raise ConnectionBroken(f"not chunked coding: {exc}") from None
            self.extra = True  # what followed the last chunk is not even a response
        body, self._body = self._body, []
        return body[0] if len(body) == 1 else b"".join(body)

    # httptools' callbacks

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        self.done = True

    def on_message_begin(self) -> None:
        if self.done:  # bytes after the last chunk start another message
            self.extra = True


class _Watchdog:
    """The read timeout of one request with one timer: reads only note the time; when the timer fires it
    either re-arms for the remaining silence or, past `timeout`, aborts the connection (the pending read then
    ends and the response reports `ReadTimedOut`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout: float, transport: asyncio.BaseTransport) -> None:
        self._loop = loop
        self._timeout = timeout
        self._transport = transport
        self.expired = False
        self.last = loop.time()
        self._handle = loop.call_at(self.last + timeout, self._check)

    def _check(self) -> None:
        due = self.last + self._timeout
        if self._loop.time() < due:
            self._handle = self._loop.call_at(due, self._check)
            return
        self.expired = True
        self._transport.abort()  # type: ignore[attr-defined]  # a socket transport (BaseTransport lacks the name)

    def touch(self) -> None:
        self.last = self._loop.time()

    def cancel(self) -> None:
        self._handle.cancel()


class Response:
    """One response, owning its connection until `close()` (which returns it to the pool when reusable)."""

    def __init__(
        self, pool: Http1Pool, conn: _Connection, status: int, headers: dict[str, str], watchdog: _Watchdog
    ) -> None:
        self.status = status
        self.headers = headers
        self._pool = pool
        self._conn = conn
        self._watchdog = watchdog
        self._complete = False
        keep = headers.get("connection", "").lower() != "close"
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._chunked: ChunkedDecoder | None = ChunkedDecoder()
            self._length: int | None = None
        elif "content-length" in headers:
            self._chunked = None
            try:
                self._length = int(headers["content-length"])
            except ValueError:
                raise ConnectionBroken(f"not a content-length: {headers['content-length'][:40]!r}") from None
            self._complete = self._length == 0
        else:  # the body runs to the end of the connection
            self._chunked, self._length, keep = None, None, False
        self._keep_alive = keep

    @property
    def complete(self) -> bool:
        return self._complete

    async def read_some(self) -> bytes:
        """The next body bytes (possibly several events' worth); b"" once the body is complete."""
        while not self._complete:
            data = await self._recv()
            if self._chunked is not None:
                if not data:
                    raise self._cut("the connection closed before the last chunk")
                body = self._chunked.feed(data)
                if self._chunked.done:
                    self._complete = True
                    self._keep_alive = self._keep_alive and not self._chunked.extra
                if body:
                    return body
            elif self._length is not None:
                if not data:
                    raise self._cut("the connection closed before the end of the body")
                if len(data) >= self._length:
                    self._keep_alive = self._keep_alive and len(data) == self._length
                    data, self._complete = data[: self._length], True
                self._length -= len(data)
                return data
            else:
                if not data:
                    self._complete = True
                return data
        return b""

    async def read_all(self) -> bytes:
        parts = []
        while data := await self.read_some():
            parts.append(data)
        return b"".join(parts)

    async def _recv(self) -> bytes:
        try:
            data = await self._conn.reader.read(_READ_SIZE)
        except OSError as exc:  # reset by the peer, or aborted by the watchdog
            raise self._broken(exc) from None
        if self._watchdog.expired:
            raise ReadTimedOut("no data within the read timeout")
        self._watchdog.touch()
        return data

    def _broken(self, exc: BaseException) -> TransportError:
        if self._watchdog.expired:
            return ReadTimedOut("no data within the read timeout")
        return self._cut(f"{type(exc).__name__}: {exc}")

    def _cut(self, reason: str) -> ConnectionBroken:
        """The upstream dropped this response: its idle connections are suspect too (see `forget_idle`)."""
        self._pool.forget_idle()
        return ConnectionBroken(reason)

    def close(self) -> None:
        """Release the connection: back to the pool if the body was read to the end, else closed."""
        self._watchdog.cancel()
        if self._conn is not None:
            self._pool._release(self._conn, reusable=self._complete and self._keep_alive)
            self._conn = None  # type: ignore[assignment]  # released: no read follows, so the attribute stays typed as set

    async def __aenter__(self) -> Response:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class _Connection:
    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    def usable(self) -> bool:
        """Not closed by either side while idle (a server's keep-alive timeout, llama-server's close), and silent:
        an idle connection has nothing to say, so bytes waiting on it are a server's goodbye (a 408 before its
        close: uvicorn's, Deltafin's own header timeout), never the answer to the next request."""
        return not self.reader.at_eof() and not self.writer.transport.is_closing() and not self.reader._buffer  # type: ignore[attr-defined]  # pinned: tests/gateway/test_http1.py

    def close(self) -> None:
        self.writer.transport.abort()  # no graceful close to wait for: the exchange is over or abandoned


class Http1Pool:
    """Keep-alive HTTP/1.1 connections to one upstream base URL; at most `max_idle` are kept idle.

    The pool belongs to one event loop (connections cannot move between loops); `UpstreamEngine` makes one
    per loop."""

    def __init__(
        self,
        base_url: str,
        *,
        max_idle: int,
        connect_timeout_s: float,
        read_timeout_s: float,
        headers: Mapping[str, str] | None = None,
        connect: Connector | None = None,
        spare: int = 0,
    ) -> None:
        parts = urllib.parse.urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url}")
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._tls = parts.scheme == "https"
        self._prefix = parts.path.rstrip("/")
        self._head_fields = f"Host: {parts.netloc}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._connect = connect or self._open_tcp
        self._max_idle = max_idle
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._idle: list[_Connection] = []
        #: connections kept open ahead of need (see `_refill`)
        self._spare = min(spare, max_idle)
        self._opening = 0
        self._background: set[asyncio.Task[None]] = set()
        self._closed = False
        #: connections opened so far (the tests and the benchmark read it)
        self.opened = 0

    async def _open_tcp(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        context = ssl.create_default_context() if self._tls else None
        return await asyncio.open_connection(self._host, self._port, ssl=context, limit=_READ_SIZE * 4)

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        *,
        read_timeout_s: float | None = None,
    ) -> Exchange:
        """`async with pool.request(...) as response:` the response head has been read; the body is yours.

        When an idle connection is at hand the request is written here and now, before the caller's next await
        (the gateway calls this on the request's own task and reads the answer on another: the upstream gets
        the request a task switch sooner). An exchange that is never entered must be `discard()`ed."""
        return Exchange(self, self._head(method, path, body, headers), read_timeout_s, path)

    def _head(self, method: str, path: str, body: bytes | None, headers: Mapping[str, str] | None) -> bytes:
        head = f"{method} {self._prefix}{path} HTTP/1.1\r\n{self._head_fields}"
        if headers:
            head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        if body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        return (head + "\r\n").encode("latin-1") + (body or b"")

    def _take_idle(self) -> _Connection | None:
        while self._idle:
            conn = self._idle.pop()
            if conn.usable():
                self._refill()
                return conn
            conn.close()
        return None

    async def _acquire(self, *, fresh: bool = False) -> tuple[_Connection, bool]:
        conn = None if fresh else self._take_idle()
        if conn is not None:
            return conn, True
        self._refill()  # for the request after this one
        reader, writer = await self._open()
        return _Connection(reader, writer), False

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            opened = await asyncio.wait_for(self._connect(), self._connect_timeout_s)
        except TimeoutError:
            raise ConnectFailed(f"ConnectTimeout after {self._connect_timeout_s:g} s") from None
        except OSError as exc:
            raise ConnectFailed(f"{type(exc).__name__}: {exc}") from None
        self.opened += 1
        return opened

    def _refill(self) -> None:
        """Open connections in the background until `spare` are idle or opening. An upstream that closes every
        streamed connection (llama-server) otherwise makes each request wait for a connect of its own."""
        if self._closed or not self._spare:
            return
        self._drop_closed_idle()
        if len(self._idle) + self._opening >= self._spare:
            return
        self._opening += 1
        task = asyncio.get_running_loop().create_task(self._open_spare())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _drop_closed_idle(self) -> None:
        """Idle connections the server has closed since (llama-server closes each streamed one) are no spares."""
        live = []
        for conn in self._idle:
            if conn.usable():
                live.append(conn)
            else:
                conn.close()
        self._idle = live

    async def _open_spare(self) -> None:
        try:
            reader, writer = await self._open()
        except ConnectFailed:
            return  # the next request connects itself, and reports the failure
        finally:
            self._opening -= 1
        self._release(_Connection(reader, writer), reusable=not self._closed)

    def _release(self, conn: _Connection, *, reusable: bool) -> None:
        if reusable and len(self._idle) < self._max_idle and conn.usable():
            self._idle.append(conn)
        else:
            conn.close()

    def forget_idle(self) -> None:
        """Close every idle connection: one of their peers died unseen (reset mid-response, or closed as it was
        reused), and the loop may not have read the others' close yet, so a request sent on one would find the
        upstream gone without asking it again."""
        while self._idle:
            self._idle.pop().close()

    def close(self) -> None:
        self._closed = True
        for task in list(self._background):
            task.cancel()
        self.forget_idle()

    def _send_now(self, raw: bytes, read_timeout_s: float | None) -> tuple[_Connection, _Watchdog] | None:
        """Write `raw` on an idle connection, if there is one (see `request`)."""
        conn = self._take_idle()
        if conn is None:
            return None
        watchdog = _Watchdog(asyncio.get_running_loop(), read_timeout_s or self._read_timeout_s, conn.writer.transport)
        conn.writer.write(raw)
        return conn, watchdog

    async def _exchange(
        self, raw: bytes, read_timeout_s: float | None, sent: tuple[_Connection, _Watchdog] | None = None
    ) -> Response:
        loop = asyncio.get_running_loop()
        for attempt in (0, 1):
            if sent is not None:  # written already on a reused connection (`_send_now`)
                (conn, watchdog), reused, sent = sent, True, None
                write: bytes | None = None
            else:
                # the second try opens a connection: the idle ones are as old as the one that died
                conn, reused = await self._acquire(fresh=attempt > 0)
                watchdog = _Watchdog(loop, read_timeout_s or self._read_timeout_s, conn.writer.transport)
                write = raw
            try:
                status, fields = await self._send_and_read_head(conn, write, watchdog)
                if status == 408 and reused:
                    # The server timed the idle connection out as we reused it (its 408 and close crossed our
                    # request): the request was never read, as with a close.
                    raise _StaleConnection()
            except _StaleConnection:
                watchdog.cancel()
                conn.close()
                # its siblings went idle at about the same time: an idle timeout or a restart took them too
                self.forget_idle()
                if reused and attempt == 0:
                    continue  # the server closed an idle connection as we reused it: one fresh try
                raise ConnectFailed("the upstream closed a new connection without answering") from None
            except BaseException:
                watchdog.cancel()
                conn.close()
                raise
            try:
                return Response(self, conn, status, fields, watchdog)
            except BaseException:
                watchdog.cancel()
                conn.close()
                raise
        raise AssertionError("unreachable")

    async def _send_and_read_head(
        self, conn: _Connection, raw: bytes | None, watchdog: _Watchdog
    ) -> tuple[int, dict[str, str]]:
        """Write `raw` (None: written already) and read the response head."""
        try:
            if raw is not None:
                conn.writer.write(raw)
            if conn.writer.transport.get_write_buffer_size():
                await asyncio.wait_for(conn.writer.drain(), self._connect_timeout_s)
            head = await conn.reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            if watchdog.expired:
                raise ReadTimedOut("no response within the read timeout") from None
            if not exc.partial:
                raise _StaleConnection() from None
            raise ConnectionBroken("the connection closed inside the response head") from None
        except asyncio.LimitOverrunError:
            raise ConnectionBroken("the response head is too long") from None
        except TimeoutError:
            raise ConnectionBroken("the request could not be written within the connect timeout") from None
        except OSError as exc:
            if watchdog.expired:
                raise ReadTimedOut("no response within the read timeout") from None
            raise _StaleConnection() from exc
        watchdog.touch()
        return _parse_head(head)


class _StaleConnection(Exception):
    """Nothing came back on a connection: closed before our request was read (safe to send again once)."""


class Exchange:
    """`async with`: opens the exchange, closes (or pools) its connection on the way out, whatever happens."""

    def __init__(self, pool: Http1Pool, raw: bytes, read_timeout_s: float | None, path: str = "") -> None:
        #: the request's path (what an adapter that may switch endpoints needs to know of a failed one)
        self.path = path
        self._pool = pool
        self._raw = raw
        self._read_timeout_s = read_timeout_s
        self._sent = pool._send_now(raw, read_timeout_s)
        self._response: Response | None = None

    def discard(self) -> None:
        """Close the connection of a request written but never entered (its task was cancelled first)."""
        if self._sent is not None:
            conn, watchdog = self._sent
            self._sent = None
            watchdog.cancel()
            conn.close()

    async def __aenter__(self) -> Response:
        sent, self._sent = self._sent, None
        self._response = await self._pool._exchange(self._raw, self._read_timeout_s, sent)
        return self._response

    async def __aexit__(self, *exc: object) -> None:
        if self._response is not None:
            self._response.close()


def _parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise ConnectionBroken(f"not an HTTP/1.1 status line: {lines[0][:80]!r}")
    fields: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise ConnectionBroken(f"not a header line: {line[:80]!r}")
        key = name.strip().lower()
        fields[key] = f"{fields[key]}, {value.strip()}" if key in fields else value.strip()
    if parts[0] == "HTTP/1.0" and fields.get("connection", "").lower() != "keep-alive":
        fields["connection"] = "close"
    return int(parts[1]), fields
