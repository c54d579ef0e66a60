"""Faults of the process and its connections, on a real server process over loopback: slow clients, too many
connections, a client that leaves mid-stream, SIGTERM with work in flight, and the one log format."""

import json
import signal
import socket
import threading
import time

import httpx
import pytest

from tests.conftest import LiveServer

pytestmark = pytest.mark.e2e

LIMITS = [
    "engine.max_batch=1",  # one row at a time, so a second request is queued behind the first
    "server.connections.header_timeout_s=1",
    "server.connections.body_timeout_s=1",
    "server.connections.max_open=4",
    "server.shutdown_grace_s=3",
]
# Long past the 3 s shutdown grace at any speed this machine decodes (the default decodes ~100 tok/s: 400 tokens
# could end inside the grace).
LONG = {"prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True, "temperature": 1.0}


@pytest.fixture(scope="module")
def server():
    # A fresh interpreter (not forked from the zygote): the last test checks what the whole process printed,
    # imports included, then stops it with SIGTERM.
    live = LiveServer(LIMITS, cold=True)
    try:
        live.wait_ready()
        yield live
    finally:
        live.stop()


def connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    return sock


def read_until_closed(sock: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that took."""
    started = time.monotonic()
    sock.settimeout(limit_s)
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data, time.monotonic() - started
        data += chunk


def json_body(response: bytes) -> dict:
    return json.loads(response.split(b"\r\n\r\n", 1)[1])


class TestSlowClients:
    def test_slow_headers_are_cut_off(self, server):
        sock = connect(server)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()
        try:
            for _ in range(20):  # a byte every 0.2 s would hold the connection forever without a deadline
                time.sleep(0.2)
                sock.sendall(b"X")
        except (BrokenPipeError, ConnectionResetError):
            pass
        data, _ = read_until_closed(sock, 5)
        assert time.monotonic() - started < 4
        assert data.startswith(b"HTTP/1.1 408") and json_body(data)["error"]["code"] == "request_timeout"

    def test_short_body_is_408_and_closed(self, server):
        sock = connect(server)
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\ncontent-length: 1000000\r\n\r\n"
        sock.sendall(head + b"{" + b" " * 1023)
        data, took = read_until_closed(sock, 5)
        assert took < 4
        assert data.startswith(b"HTTP/1.1 408") and json_body(data)["error"]["code"] == "request_timeout"

    def test_connections_beyond_the_cap_get_503(self, server):
        held = [connect(server) for _ in range(4)]
        try:
            time.sleep(0.2)
            extra = connect(server)
            data, _ = read_until_closed(extra, 5)
            assert data.startswith(b"HTTP/1.1 503") and json_body(data)["error"]["code"] == "too_many_connections"
        finally:
            for sock in held:
                sock.close()
        time.sleep(0.3)
        assert httpx.get(f"{server.base_url}/health").status_code == 200


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def send_quietly(sock: socket.socket, data: bytes, piece: int = 1 << 20) -> None:
    """Sends until done or until the server stops reading (it answered and closed)."""
    try:
        for start in range(0, len(data), piece):
            sock.sendall(data[start : start + piece])
    except OSError:  # BrokenPipe / ConnectionReset once the server closed
        pass


class TestHeaderSize:
    """server.connections.max_header_bytes (32 KiB by default): past it 431 and closed, while the head arrives.
    On the shared server with default connection limits (this module's allows only 4 connections)."""

    @pytest.fixture
    def server(self, live_server):
        return live_server

    HEAD = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"

    def refused(self, server, head: bytes) -> bytes:
        sock = connect(server)
        sender = threading.Thread(target=send_quietly, args=(sock, head), daemon=True)
        sender.start()
        try:
            data, _ = read_until_closed(sock, 10)
        finally:
            sender.join(10)
            sock.close()
        return data

    def test_a_4_mib_header_gets_431_and_the_connection_closed(self, server):
        data = self.refused(server, self.HEAD + b"X-Big: " + b"a" * (4 << 20) + b"\r\n\r\n")
        assert (
            data.startswith(b"HTTP/1.1 431") and json_body(data)["error"]["code"] == "request_header_fields_too_large"
        )

    def test_a_head_over_the_limit_in_one_read_is_refused_and_one_under_it_served(self, server):
        many = b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 200) for i in range(200))  # ~42 KiB of small headers
        assert self.refused(server, self.HEAD + many + b"\r\n").startswith(b"HTTP/1.1 431")
        headers = {f"x-h{i}": "v" * 200 for i in range(100)}  # ~21 KiB
        assert httpx.get(f"{server.base_url}/v1/models", headers=headers).status_code == 200

    def test_a_chunked_bodys_trailer_counts_against_the_limit(self, server):
        """Before, a trailer was buffered whole, before the API key was checked (32 connections held 748 MiB)."""
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n"
        data = self.refused(server, head + b"X-Trailer: " + b"a" * (4 << 20) + b"\r\n\r\n")
        assert (
            data.startswith(b"HTTP/1.1 431") and json_body(data)["error"]["code"] == "request_header_fields_too_large"
        )

    def test_small_requests_pipelined_past_the_limit_are_all_answered(self, server):
        requests = b"".join(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: %s\r\n\r\n" % (b"p" * 1000) for _ in range(48))
        assert len(requests) > 32768  # one write of them, over the limit in all, each far under it
        sock = connect(server)
        try:
            sock.sendall(requests + b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            data, _ = read_until_closed(sock, 30)
        finally:
            sock.close()
        assert data.count(b"HTTP/1.1 200 OK") == 49 and b"HTTP/1.1 431" not in data

    def test_unfinished_40_mib_headers_on_18_connections_hold_no_memory(self, server):
        before = rss_bytes(server.process.pid)
        peak = before
        head = self.HEAD + b"X-Big: " + b"a" * (40 << 20)  # never finished
        socks = [connect(server) for _ in range(18)]
        senders = [threading.Thread(target=send_quietly, args=(sock, head), daemon=True) for sock in socks]
        for sender in senders:
            sender.start()
        while any(sender.is_alive() for sender in senders):
            peak = max(peak, rss_bytes(server.process.pid))
            time.sleep(0.05)
        answers = [read_until_closed(sock, 10)[0] for sock in socks]
        for sock in socks:
            sock.close()
        assert all(answer.startswith(b"HTTP/1.1 431") for answer in answers)
        # Before the limit, 18 x 40 MiB of unfinished header raised RSS by 276 MB.
        assert peak - before < 48 << 20, (before, peak)
        assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_disconnect_mid_stream_logs_the_tokens_generated(server):
    request_id = "disconnect-mid-stream"
    with httpx.Client(timeout=30) as client:
        with client.stream(
            "POST",
            f"{server.base_url}/v1/completions",
            json={**LONG, "stream": True},
            headers={"x-request-id": request_id},
        ) as response:
            lines = response.iter_lines()
            seen = 0
            for line in lines:
                if line.startswith("data: {"):
                    seen += 1
                if seen >= 4:
                    break
    line = server.request_log(request_id, timeout=15)
    assert line["completed"] is False and line["completion_tokens"] >= 3


def test_every_log_line_is_json(server):
    httpx.get(f"{server.base_url}/v1/models")
    lines = [line for line in server.log_lines() if line.strip()]
    assert any('"logger": "uvicorn.error"' in line for line in lines)  # uvicorn's boot lines, as JSON
    bad = [line for line in lines if not line.startswith("{")]  # no progress bar either
    assert not bad, bad[:5]
    records = [json.loads(line) for line in lines if line.startswith("{")]
    # Nothing above (slow clients, a client leaving mid-stream) is a server error.
    assert not [r for r in records if r["level"] in ("error", "critical")]


def test_sigterm_drains_and_exits_zero(server):
    """The module's last test: it stops the module's server."""
    live = server
    try:
        base = live.base_url
        events: list[str] = []
        queued: dict = {}

        def stream_long():
            with httpx.stream("POST", f"{base}/v1/completions", json={**LONG, "stream": True}, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])

        def wait_in_queue():
            response = httpx.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
            queued["status"], queued["body"] = response.status_code, response.json()

        streamer = threading.Thread(target=stream_long)
        streamer.start()
        deadline = time.monotonic() + 60
        while len(events) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        waiter = threading.Thread(target=wait_in_queue)
        waiter.start()
        time.sleep(0.5)  # it is queued behind the stream (one engine)

        live.process.send_signal(signal.SIGTERM)
        started = time.monotonic()
        waiter.join(30)
        streamer.join(30)
        rc = live.process.wait(30)

        assert queued["status"] == 503 and queued["body"]["error"]["code"] == "server_shutting_down"
        # The stream ran past the 3 s grace: it ends with an error event, then [DONE].
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "server_shutting_down"
        assert rc == 0
        assert time.monotonic() - started < 15
        # From start to stop (every test of this module in between), stdout and stderr hold JSON log lines only
        # (no progress bar at load, none of triton's "nanobind: leaked" lines at exit).
        lines = live.log_lines()
        assert lines and all(isinstance(json.loads(line), dict) for line in lines), lines[:5]
        assert any("Uvicorn running on http://127.0.0.1:" in line for line in lines)
    finally:
        if live.process.poll() is None:
            live.stop()
