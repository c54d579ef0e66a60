"""The gateway's HTTP/1.1 client: chunked decoding and SSE framing at every split, connection reuse, timeouts,
and streams that end badly, against the fake upstream over real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import warnings

import pytest

from deltafin.engine import GenerationJob
from deltafin.engine.upstream import http1
from deltafin.engine.upstream.http1 import ChunkedDecoder, ConnectionBroken, Http1Pool
from deltafin.engine.upstream.llama_server import LlamaServerAdapter
from deltafin.engine.upstream.wire import SseSplitter
from deltafin.protocol.sampling import SamplingParams
from deltafin.testing.upstream_fakes import DROP, Fake, ScriptedBody, collect, make_front

CHUNKED = b"5\r\nhello\r\n1;ext=1\r\n \r\n6\r\nworld!\r\n0\r\nx-trailer: 1\r\n\r\n"


def decode_in(parts: list[bytes]) -> tuple[bytes, ChunkedDecoder]:
    decoder = ChunkedDecoder()
    return b"".join(decoder.feed(part) for part in parts), decoder


class TestChunkedDecoder:
    @pytest.mark.parametrize("cut", range(len(CHUNKED) + 1))
    def test_split_at_every_byte_boundary(self, cut):
        body, decoder = decode_in([CHUNKED[:cut], CHUNKED[cut:]])
        assert body == b"hello world!" and decoder.done and not decoder.extra

    def test_one_byte_at_a_time(self):
        body, decoder = decode_in([CHUNKED[i : i + 1] for i in range(len(CHUNKED))])
        assert body == b"hello world!" and decoder.done

    def test_not_done_before_the_last_chunk(self):
        body, decoder = decode_in([CHUNKED[:-7]])
        assert body == b"hello world!" and not decoder.done

    def test_bytes_after_the_last_chunk_are_reported(self):
        _, decoder = decode_in([b"0\r\n\r\nHTTP/1.1"])
        assert decoder.done and decoder.extra

    @pytest.mark.parametrize(
        "bad", [b"zz\r\nhello\r\n", b"-5\r\nhello\r\n", b"\r\n", b"5\r\nhello!!\r\n", b"0x5\r\nhello\r\n"]
    )
    def test_framing_that_is_not_chunked_coding_is_refused(self, bad):
        with pytest.raises(ConnectionBroken):
            ChunkedDecoder().feed(bad)


SSE = b'data: {"a": 1}\n\ndata:{"b": 2}\r\n\r\n: ping\n\nevent: x\ndata: {"c":\ndata: 3}\n\ndata: [DONE]\n\n'
EVENTS = [b'{"a": 1}', b'{"b": 2}', b'{"c":\n3}', b"[DONE]"]


class TestSseSplitter:
    @pytest.mark.parametrize("cut", range(len(SSE) + 1))
    def test_events_split_across_reads_at_every_byte(self, cut):
        splitter = SseSplitter()
        assert splitter.feed(SSE[:cut]) + splitter.feed(SSE[cut:]) == EVENTS

    def test_crlf_and_cr_line_ends_split_between_reads(self):
        raw = b"data: 1\r\n\r\ndata: 2\r\rdata: 3\r\ndata: 4\r\n\r\n"
        for cut in range(len(raw) + 1):
            splitter = SseSplitter()
            assert splitter.feed(raw[:cut]) + splitter.feed(raw[cut:]) == [b"1", b"2", b"3\n4"], cut

    def test_data_with_and_without_the_space(self):
        assert SseSplitter().feed(b"data:x\n\ndata: y\n\ndata:  z\n\n") == [b"x", b"y", b" z"]

    def test_an_event_without_its_blank_line_is_not_returned(self):
        splitter = SseSplitter()
        assert splitter.feed(b'data: {"a": 1}\n\ndata: {"b"') == [b'{"a": 1}']
        assert splitter.feed(b"") == []


def job(max_tokens=8, **params):
    return GenerationJob((1, 2), SamplingParams(max_tokens=max_tokens, temperature=0.0, **params))


def llama_events(ids):
    out = [{"content": "x", "tokens": [i], "stop": False} for i in ids]
    out.append(
        {
            "content": "",
            "tokens": [],
            "stop": True,
            "stop_type": "limit",
            "tokens_evaluated": 2,
            "timings": {"cache_n": 0},
        }
    )
    return out


@pytest.fixture
def ids(bundle):
    return bundle.tokenizer("Hello there, world", add_special_tokens=False).input_ids


class TestConnectionReuse:
    def test_sequential_requests_share_one_tcp_connection(self, bundle, ids):
        fake = Fake(lambda b, p: ScriptedBody(llama_events(ids), delay=0.002, tail=b""))

        async def scenario():
            server, url = await fake.serve_tcp()
            async with server:
                front = make_front(LlamaServerAdapter, bundle, fake, url=url, tcp=True)
                outs = [await collect(front, job(max_tokens=len(ids))) for _ in range(3)]
                await front.aclose()
            return outs

        outs = asyncio.run(scenario())
        assert [o.text for o in outs] == ["Hello there, world"] * 3
        assert len(fake.requests) == 3 and fake.connections == 1

    def test_a_request_closed_early_does_not_return_its_connection(self, bundle, ids):
        fake = Fake(lambda b, p: ScriptedBody(llama_events(ids), delay=0.01, tail=b""))
        front = make_front(LlamaServerAdapter, bundle, fake)

        async def scenario():
            stopped = await collect(front, job(max_tokens=len(ids), stop=("there",)))
            whole = await collect(front, job(max_tokens=len(ids)))
            return stopped, whole

        stopped, whole = asyncio.run(scenario())
        assert stopped.text == "Hello " and fake.bodies[0].closed_early
        assert whole.text == "Hello there, world" and fake.connections == 2

    def test_a_server_that_closes_idle_connections_is_reconnected_to(self, bundle, ids):
        # llama-server closes the connection after each streamed response; the next request reconnects.
        fake = Fake(lambda b, p: Closing(llama_events(ids), tail=b""))
        front = make_front(LlamaServerAdapter, bundle, fake)

        async def scenario():
            return [await collect(front, job(max_tokens=len(ids))) for _ in range(3)]

        assert [o.text for o in asyncio.run(scenario())] == ["Hello there, world"] * 3 and fake.connections == 3

    @pytest.mark.parametrize("when", ["while idle", "as the request arrives"])
    def test_a_server_that_times_an_idle_connection_out_with_408_is_reconnected_to(self, when):
        """uvicorn (a Deltafin upstream's header timeout) answers an idle keep-alive connection 408 and closes it.
        Whether that 408 waits in the socket or crosses the next request, the request goes out once more on a
        fresh connection and its own answer comes back, never the stale 408."""
        timeout_408 = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
        ok = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 12\r\n\r\n{"ok": true}'
        connections = []

        async def serve(reader, writer):
            connections.append(writer)
            try:
                await reader.readuntil(b"\r\n\r\n")
                writer.write(ok)
                if when == "while idle":
                    await asyncio.sleep(0.05)
                else:
                    await reader.readuntil(b"\r\n\r\n")  # the next request: answered with the timeout
                writer.write(timeout_408)
                await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                pass  # the client closed first
            writer.close()

        async def scenario():
            server = await asyncio.start_server(serve, "127.0.0.1", 0)
            url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
            async with server:
                pool = Http1Pool(url, max_idle=2, connect_timeout_s=1, read_timeout_s=2)
                answers = []
                for _ in range(2):
                    async with pool.request("GET", "/") as response:
                        answers.append((response.status, await response.read_all()))
                    await asyncio.sleep(0.2)
                pool.close()
            return answers

        assert asyncio.run(scenario()) == [(200, b'{"ok": true}')] * 2 and len(connections) == 2

    def test_pool_keeps_at_most_max_idle_connections(self):
        fake = Fake(lambda b, p: (200, {"ok": True}))

        async def scenario():
            pool = Http1Pool(
                "http://up.test", max_idle=1, connect_timeout_s=1, read_timeout_s=1, connect=fake.connector()
            )
            async with pool.request("GET", "/a") as first, pool.request("GET", "/b") as second:
                bodies = [json.loads(await first.read_all()), json.loads(await second.read_all())]
            async with pool.request("GET", "/c") as third:
                await third.read_all()
            pool.close()
            return bodies, pool.opened

        bodies, opened = asyncio.run(scenario())
        assert bodies == [{"ok": True}] * 2 and opened == 2 and fake.connections == 2
        assert [p for p, _ in fake.requests] == ["/a", "/b", "/c"]


class Closing(ScriptedBody):
    """llama-server's way: the connection closes after each streamed response."""

    async def write(self, reader, writer):
        await super().write(reader, writer)
        return False


class TestSpareConnections:
    """`engine.spare_connections`: a connection opened ahead of need, and a request written on the request's own
    task when one is idle (no task switch, no connect, before the upstream sees it)."""

    def test_each_request_finds_a_connection_opened_ahead(self, bundle, ids):
        fake = Fake(lambda b, p: Closing(llama_events(ids), tail=b""))
        front = make_front(LlamaServerAdapter, bundle, fake, spare_connections=1)
        engine = front.client
        opened_before_each: list[int] = []

        async def scenario():
            outs = []
            for _ in range(3):
                opened_before_each.append(fake.connections)
                outs.append(await collect(front, job(max_tokens=len(ids))))
            await asyncio.sleep(0.05)  # the spare for a fourth
            return outs, engine.pool.opened

        outs, opened = asyncio.run(scenario())
        assert [o.text for o in outs] == ["Hello there, world"] * 3
        # The first request opened its own and a spare; each later one used the spare left for it and opened the
        # next: one connection ahead throughout, none opened while a request waited.
        assert opened_before_each == [0, 2, 3] and fake.connections == 4 and opened == 4

    def test_an_idle_connection_carries_the_request_before_any_await(self):
        fake = Fake(lambda b, p: (200, {"path": p}))

        async def scenario():
            pool = Http1Pool(
                "http://up.test", max_idle=2, connect_timeout_s=1, read_timeout_s=1, connect=fake.connector(), spare=1
            )
            async with pool.request("GET", "/a") as response:
                await response.read_all()
            exchange = pool.request("GET", "/b")
            written_at_once = exchange._sent is not None
            async with exchange as response:
                body = json.loads(await response.read_all())
            pool.close()
            return written_at_once, body

        written_at_once, body = asyncio.run(scenario())
        assert written_at_once and body == {"path": "/b"}

    def test_a_request_written_but_never_entered_closes_its_connection(self):
        fake = Fake(lambda b, p: (200, {"path": p}))

        async def scenario():
            pool = Http1Pool(
                "http://up.test", max_idle=2, connect_timeout_s=1, read_timeout_s=1, connect=fake.connector()
            )
            async with pool.request("GET", "/a") as response:
                await response.read_all()
            exchange = pool.request("GET", "/b")
            conn = exchange._sent[0]
            exchange.discard()
            exchange.discard()  # twice is harmless
            async with pool.request("GET", "/c") as response:
                body = json.loads(await response.read_all())
            pool.close()
            return conn.usable(), body

        usable, body = asyncio.run(scenario())
        assert not usable and body == {"path": "/c"} and fake.connections == 2  # /c had to connect again

    def test_a_shutdown_before_the_choice_ran_closes_the_written_connection(self, bundle, ids):
        from deltafin.engine.stream import GenerationStream

        fake = Fake(lambda b, p: ScriptedBody(llama_events(ids), delay=0.01, tail=b""))
        front = make_front(LlamaServerAdapter, bundle, fake)
        engine = front.client

        async def scenario():
            await collect(front, job(max_tokens=len(ids)))  # leaves a keep-alive connection idle
            stream = GenerationStream(asyncio.get_running_loop())
            engine.submit([job(max_tokens=len(ids))], stream)  # written at once on the idle connection
            await engine.aclose()  # cancels the choice's task before it ever ran
            events = [event async for event in stream]
            for _ in range(50):
                if len(fake.bodies) == 2 and fake.bodies[1].closed_early:
                    break
                await asyncio.sleep(0.01)
            return events

        gc.collect()  # what earlier tests left behind is not this test's
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)  # a transport left to the garbage collector says so
            events = asyncio.run(scenario())
            gc.collect()
        assert events == [] and fake.bodies[1].closed_early
        assert not [w for w in caught if "unclosed" in str(w.message)]

    def test_a_client_gone_at_once_stops_the_written_request(self, bundle, ids):
        from deltafin.engine.stream import GenerationStream

        fake = Fake(lambda b, p: ScriptedBody(llama_events(ids), delay=0.01, tail=b""))
        front = make_front(LlamaServerAdapter, bundle, fake)
        engine = front.client

        async def scenario():
            await collect(front, job(max_tokens=len(ids)))
            stream = GenerationStream(asyncio.get_running_loop())
            engine.submit([job(max_tokens=len(ids))], stream)
            stream.close()
            events = [event async for event in stream]
            for _ in range(50):
                if len(fake.bodies) == 2 and fake.bodies[1].closed_early:
                    break
                await asyncio.sleep(0.01)
            return events, engine.pool._idle

        events, idle = asyncio.run(scenario())
        assert events == [] and fake.bodies[1].closed_early and not idle

    def test_a_refused_spare_leaves_the_next_request_to_connect(self, bundle, ids):
        # Both the request's connect and the spare's are refused; then the upstream is back.
        fake = Fake(lambda b, p: ScriptedBody(llama_events(ids), tail=b""), refuse=2)
        front = make_front(LlamaServerAdapter, bundle, fake, spare_connections=1)

        async def scenario():
            down = await collect(front, job(max_tokens=len(ids)))
            up = await collect(front, job(max_tokens=len(ids)))
            return down, up

        down, up = asyncio.run(scenario())
        assert down.start_error is not None and down.start_error.status == 503
        assert up.text == "Hello there, world" and fake.refuse == 0


class TestBadStreams:
    def test_events_split_across_http_chunks(self, bundle, ids):
        def bytewise(data):
            return [data[i : i + 3] for i in range(0, len(data), 3)]

        fake = Fake(lambda b, p: ScriptedBody(llama_events(ids), tail=b"", chunks=bytewise))
        out = asyncio.run(collect(make_front(LlamaServerAdapter, bundle, fake), job(max_tokens=len(ids))))
        assert out.text == "Hello there, world" and out.finished.reason == "length"

    def test_stream_cut_mid_event_after_a_token_is_an_in_stream_502(self, bundle, ids):
        events = llama_events(ids)[:1] + [b'data: {"content": "x", "tok']
        fake = Fake(lambda b, p: ScriptedBody(events, tail=b""))
        out = asyncio.run(collect(make_front(LlamaServerAdapter, bundle, fake), job()))
        assert out.start_error is None and out.text == "Hello" and out.error.status == 502

    def test_connection_dropped_mid_event_is_a_502(self, bundle, ids):
        fake = Fake(lambda b, p: ScriptedBody([b'data: {"content": "x", "tok', DROP]))
        out = asyncio.run(collect(make_front(LlamaServerAdapter, bundle, fake), job()))
        assert out.start_error.status == 502 and out.start_error.code == "upstream_error"

    def test_a_silent_upstream_is_a_504_before_the_first_token(self, bundle, ids):
        fake = Fake(lambda b, p: ScriptedBody(llama_events(ids), delay=2.0))
        front = make_front(LlamaServerAdapter, bundle, fake, read_timeout_s=0.2)
        out = asyncio.run(collect(front, job()))
        assert out.start_error.status == 504 and out.start_error.code == "upstream_timeout"
        assert front.admission.in_use == 0

    def test_a_silence_after_tokens_is_an_in_stream_504(self, bundle, ids):
        class Stalls(ScriptedBody):
            async def write(self, reader, writer):
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                )
                data = self.encoded(self.events[0])
                writer.write(b"%x\r\n%s\r\n" % (len(data), data))
                await asyncio.sleep(2.0)
                return False

        fake = Fake(lambda b, p: Stalls(llama_events(ids)))
        out = asyncio.run(collect(make_front(LlamaServerAdapter, bundle, fake, read_timeout_s=0.3), job()))
        assert out.start_error is None and out.text == "Hello" and out.error.status == 504

    def test_steady_tokens_slower_in_total_than_the_read_timeout_are_fine(self, bundle, ids):
        # The timeout bounds the silence between events, not the whole generation.
        fake = Fake(lambda b, p: ScriptedBody(llama_events(ids), delay=0.1, tail=b""))
        front = make_front(LlamaServerAdapter, bundle, fake, read_timeout_s=0.25)
        out = asyncio.run(collect(front, job(max_tokens=len(ids))))
        assert out.text == "Hello there, world" and out.error is None


def test_garbage_after_the_last_chunk_is_extra_not_an_error():
    _, decoder = decode_in([b"0\r\n\r\n", b"\x00garbage"])
    assert decoder.done and decoder.extra


class TestAnUpstreamThatDies:
    """A killed upstream: what the next request meets must say "unavailable, try again" (503), never a stale idle
    connection's failure (502)."""

    def test_a_new_connection_closed_unanswered_is_unreachable(self, bundle, ids):
        # vLLM's engine process keeps the killed API server's listening socket for a moment: connects succeed and
        # each connection is closed without a byte of answer.
        async def serve(reader, writer):
            with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
                await reader.readuntil(b"\r\n\r\n")
            writer.transport.abort()

        async def scenario():
            server = await asyncio.start_server(serve, "127.0.0.1", 0)
            url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
            async with server:
                front = make_front(LlamaServerAdapter, bundle, Fake(lambda b, p: (500, {})), url=url, tcp=True)
                out = await collect(front, job(max_tokens=len(ids)))
                health = front.client.health._state
                await front.aclose()
            return out, health

        out, health = asyncio.run(scenario())
        assert out.start_error is not None and out.start_error.status == 503, out
        assert "without answering" in str(out.start_error) and health is not None and not health.ready

    def test_a_stream_cut_mid_body_drops_the_idle_connections(self):
        ok = b'HTTP/1.1 200 OK\r\ncontent-length: 12\r\n\r\n{"ok": true}'
        cut = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n"

        async def serve(reader, writer):
            with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    if head.startswith(b"GET /cut"):
                        writer.write(cut)
                        await writer.drain()
                        break
                    writer.write(ok)
            writer.transport.abort()

        async def scenario():
            server = await asyncio.start_server(serve, "127.0.0.1", 0)
            url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
            async with server:
                pool = Http1Pool(url, max_idle=4, connect_timeout_s=1, read_timeout_s=2)
                async with pool.request("GET", "/a") as a, pool.request("GET", "/b") as b:
                    await a.read_all(), await b.read_all()
                idle_before = len(pool._idle)
                with pytest.raises(ConnectionBroken):
                    async with pool.request("GET", "/cut") as response:
                        await response.read_all()
                idle_after = len(pool._idle)
                pool.close()
            return idle_before, idle_after

        assert asyncio.run(scenario()) == (2, 0)

    def test_a_dead_idle_connection_is_retried_on_a_new_one_not_on_its_siblings(self, monkeypatch):
        # Two idle connections to a server that has since died, neither's close seen yet by the loop: the request
        # written on one finds it dead; its retry must not take the other, which is as dead, but connect afresh.
        ok = b'HTTP/1.1 200 OK\r\ncontent-length: 12\r\n\r\n{"ok": true}'
        writers = []

        async def serve(reader, writer):
            writers.append(writer)
            with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
                while True:
                    await reader.readuntil(b"\r\n\r\n")
                    writer.write(ok)

        async def scenario():
            server = await asyncio.start_server(serve, "127.0.0.1", 0)
            url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
            pool = Http1Pool(url, max_idle=4, connect_timeout_s=1, read_timeout_s=2)
            async with pool.request("GET", "/a") as a, pool.request("GET", "/b") as b:
                await a.read_all(), await b.read_all()
            server.close()
            for writer in writers:  # the server dies: its connections close, which the client has not read
                writer.transport.abort()
            await server.wait_closed()  # (from Python 3.12.1 on it waits for the connections to be gone)
            # hide the closes from the pool's checks, as a race with the loop would
            monkeypatch.setattr(http1._Connection, "usable", lambda conn: True)
            try:
                async with pool.request("GET", "/c") as response:
                    await response.read_all()
            except Exception as exc:  # noqa: BLE001 - the test reports which
                return type(exc).__name__
            finally:
                pool.close()
            return "answered"

        assert asyncio.run(scenario()) == "ConnectFailed"
