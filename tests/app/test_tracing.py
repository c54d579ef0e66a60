"""OpenTelemetry traces (deltafin.app.tracing, server.tracing): one server span per generation request with the
GenAI attributes, the engine's queue wait, prefill (its chunks) and decode spans under it, upstream calls as client
spans whose ids went out in their traceparent; an incoming traceparent continued. Captured by an in-memory
exporter, and by a local OTLP/HTTP receiver through the real exporter; nothing of the SDK is imported when off."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from litestar.testing import TestClient
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from deltafin.app import build_app
from deltafin.app.generation import GENERATION_ROUTES
from deltafin.app.services import Services
from deltafin.app.tracing import RequestTracer, traces_url
from deltafin.engine import EngineFront
from deltafin.engine.local.engine import LocalEngine
from tests.conftest import REPO, compose_config

TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
PARENT_ID = 0x00F067AA0BA902B7
TRACEPARENT = f"00-{TRACE_ID:032x}-{PARENT_ID:016x}-01"
#: a prompt of ~150 tokens: several prefill chunks of 16 positions
LONG = [{"role": "user", "content": "Tell me about the sea. " * 25}]


def traced_app(config, services, exporter):
    tracer = RequestTracer(config.server.tracing, frozenset(GENERATION_ROUTES), exporter)
    return TestClient(build_app(config, services, tracer=tracer))


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def client(loaded_model, exporter):
    config = compose_config(["server.tracing.otlp_endpoint=http://127.0.0.1:9"])
    front = EngineFront(LocalEngine(loaded_model, prefill_chunk=16), max_waiting=4, timeout_s=30, memo_entries=8)
    with traced_app(config, Services.from_engine(config, front), exporter) as client:
        yield client


def spans_of(exporter, trace_id=None):
    """The finished spans (of one trace), and the request's server span among them."""
    spans = [s for s in exporter.get_finished_spans() if trace_id is None or s.context.trace_id == trace_id]
    (root,) = [s for s in spans if s.kind == SpanKind.SERVER]
    return spans, root


def children(spans, parent):
    return sorted(
        (s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id),
        key=lambda s: s.start_time,
    )


class TestLocalEngine:
    def test_the_span_tree_and_its_genai_attributes(self, client, exporter):
        exporter.clear()
        response = client.post(
            "/v1/chat/completions",
            json={"messages": LONG, "max_tokens": 4, "n": 2, "temperature": 0.5, "top_k": 7, "seed": 3},
            headers={"traceparent": TRACEPARENT},
        )
        assert response.status_code == 200
        spans, root = spans_of(exporter)
        # the incoming trace is continued under its parent span
        assert root.context.trace_id == TRACE_ID and root.parent.span_id == PARENT_ID
        assert root.name == "chat SmolLM2-135M-Instruct"
        usage, attributes = response.json()["usage"], root.attributes
        assert attributes["gen_ai.operation.name"] == "chat"
        assert attributes["gen_ai.request.model"] == attributes["gen_ai.response.model"] == "SmolLM2-135M-Instruct"
        assert attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
        assert attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
        assert attributes["gen_ai.response.finish_reasons"] == ("length", "length")
        assert attributes["gen_ai.request.temperature"] == 0.5 and attributes["gen_ai.request.top_k"] == 7
        assert attributes["gen_ai.request.top_p"] == 0.9  # the model's default, which applied
        assert attributes["gen_ai.request.max_tokens"] == 4 and attributes["gen_ai.request.choice.count"] == 2
        assert 0 < attributes["gen_ai.latency.time_to_first_token"] <= attributes["gen_ai.latency.e2e"]
        assert attributes["http.response.status_code"] == 200 and root.status.status_code == StatusCode.UNSET
        names = [s.name for s in children(spans, root)]
        assert names[:2] == ["queue", "prefill"] and names[2:] == ["decode", "decode"]
        queue, prefill, *decodes = children(spans, root)
        chunks = children(spans, prefill)
        assert len(chunks) >= 2 and {c.name for c in chunks} == {"prefill chunk"}
        assert (
            sum(c.attributes["deltafin.positions"] for c in chunks)
            == usage["prompt_tokens"] - prefill.attributes["gen_ai.usage.cache_read.input_tokens"]
        )
        # in the order they happened, each inside the request's span
        assert root.start_time <= queue.start_time <= queue.end_time <= prefill.start_time
        assert prefill.start_time <= chunks[0].start_time and chunks[-1].end_time <= prefill.end_time
        for decode in decodes:
            assert prefill.end_time <= decode.start_time <= decode.end_time <= root.end_time
            assert decode.attributes["gen_ai.usage.output_tokens"] == 4
        assert {d.attributes["deltafin.choice"] for d in decodes} == {0, 1}

    def test_a_reused_prefix_is_the_prefill_spans_cache_read(self, client, exporter):
        body = {"messages": [{"role": "user", "content": "Name the oceans. " * 20}], "max_tokens": 2}
        assert client.post("/v1/chat/completions", json=body).status_code == 200  # the prefix cache holds it now
        exporter.clear()
        response = client.post("/v1/chat/completions", json=body)  # sampled without a seed: no memo replay
        usage = response.json()["usage"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        spans, root = spans_of(exporter)
        (prefill,) = [s for s in children(spans, root) if s.name == "prefill"]
        assert cached > 0 and root.attributes["gen_ai.usage.cache_read.input_tokens"] == cached
        assert prefill.attributes["gen_ai.usage.cache_read.input_tokens"] == cached
        assert sum(c.attributes["deltafin.positions"] for c in children(spans, prefill)) == (
            usage["prompt_tokens"] - cached
        )

    def test_streamed_completions_are_text_completion_spans(self, client, exporter):
        exporter.clear()
        with client.stream(
            "POST", "/v1/completions", json={"prompt": "Once upon", "max_tokens": 3, "stream": True}
        ) as r:
            body = "".join(r.iter_text())
        assert body.endswith("data: [DONE]\n\n")
        spans, root = spans_of(exporter)
        assert root.name == "text_completion SmolLM2-135M-Instruct" and root.attributes["deltafin.completed"] is True
        assert root.context.trace_id != TRACE_ID and root.parent is None  # a new trace
        assert [s.name for s in children(spans, root)] == ["queue", "prefill", "decode"]

    def test_responses_and_other_routes(self, client, exporter):
        exporter.clear()
        assert client.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 2}).status_code == 200
        assert client.get("/v1/models").status_code == 200 and client.get("/health").status_code == 200
        spans, root = spans_of(exporter)  # one server span: the generation request's alone
        assert root.name == "chat SmolLM2-135M-Instruct" and root.attributes["url.path"] == "/v1/responses"

    def test_a_refused_request_is_a_span_without_engine_work(self, client, exporter):
        exporter.clear()
        response = client.post("/v1/chat/completions", json={"messages": "no"}, headers={"traceparent": TRACEPARENT})
        assert response.status_code == 400
        spans, root = spans_of(exporter)
        assert spans == [root] and root.attributes["http.response.status_code"] == 400
        assert root.status.status_code == StatusCode.UNSET  # a client's error is not the server's

    def test_a_memo_replay_has_no_engine_spans(self, client, exporter):
        body = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 3, "temperature": 0}
        client.post("/v1/chat/completions", json=body)
        exporter.clear()
        client.post("/v1/chat/completions", json=body)
        spans, root = spans_of(exporter)
        assert root.attributes["deltafin.memo_hit"] is True and spans == [root]

    def test_an_unsampled_parent_is_followed(self, client, exporter):
        exporter.clear()
        unsampled = TRACEPARENT[:-2] + "00"
        response = client.post(
            "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers={"traceparent": unsampled}
        )
        assert response.status_code == 200 and exporter.get_finished_spans() == ()

    @pytest.mark.parametrize("header", ["garbage", "00-" + "0" * 32 + "-" + "0" * 16 + "-01", "ff-x-y-z", "🙂"])
    def test_a_malformed_traceparent_starts_a_new_trace(self, client, exporter, header):
        exporter.clear()
        response = client.post(
            "/v1/completions",
            json={"prompt": "Hi", "max_tokens": 1},
            headers={"traceparent": header.encode("utf-8")},
        )
        assert response.status_code == 200
        _, root = spans_of(exporter)
        assert root.parent is None and root.context.trace_id != 0


def test_sample_ratio_zero_records_nothing_new(loaded_model):
    exporter = InMemorySpanExporter()
    config = compose_config(["server.tracing.otlp_endpoint=http://127.0.0.1:9", "server.tracing.sample_ratio=0"])
    front = EngineFront(LocalEngine(loaded_model), max_waiting=4, timeout_s=30, memo_entries=0)
    with traced_app(config, Services.from_engine(config, front), exporter) as client:
        client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        assert exporter.get_finished_spans() == ()
        client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers={"traceparent": TRACEPARENT})
        assert len(exporter.get_finished_spans()) >= 3  # a sampled parent is followed whatever the ratio


@pytest.fixture(scope="module")
def bundle(config):
    from deltafin.engine.weights.tokenizer_only import load_tokenizer_only

    return load_tokenizer_only(config.model)


class TestUpstream:
    """The gateway: each upstream call is a client span, and the upstream gets a traceparent naming it."""

    EVENTS = [
        {"content": "x", "tokens": [28], "stop": False},
        {
            "content": "",
            "tokens": [],
            "stop": True,
            "stop_type": "limit",
            "tokens_evaluated": 2,
            "timings": {"cache_n": 0},
        },
    ]

    def gateway(self, bundle, exporter, overrides):
        from deltafin.engine.upstream.llama_server import LlamaServerAdapter
        from deltafin.testing.upstream_fakes import Fake, ScriptedBody, make_engine

        config = compose_config(["server.memo.entries=0", *overrides])
        fake = Fake(lambda body, path: ScriptedBody(self.EVENTS, tail=b""))
        front = EngineFront(make_engine(LlamaServerAdapter, bundle, fake), max_waiting=4, timeout_s=5, memo_entries=0)
        services = Services.from_engine(config, front)
        app = (
            traced_app(config, services, exporter) if exporter is not None else TestClient(build_app(config, services))
        )
        return app, fake

    def test_traceparent_is_continued_and_forwarded_under_the_call_span(self, bundle):
        exporter = InMemorySpanExporter()
        client, fake = self.gateway(bundle, exporter, ["server.tracing.otlp_endpoint=http://127.0.0.1:9"])
        with client:
            body = {"prompt": "Hi", "max_tokens": 1, "n": 2}
            assert client.post("/v1/completions", json=body, headers={"traceparent": TRACEPARENT}).status_code == 200
        spans, root = spans_of(exporter)
        calls = [s for s in spans if s.kind == SpanKind.CLIENT]
        assert len(calls) == 2 and all(c.parent.span_id == root.context.span_id for c in calls)
        assert root.context.trace_id == TRACE_ID and root.parent.span_id == PARENT_ID
        sent = sorted(headers["traceparent"] for headers in fake.headers)
        assert sent == sorted(f"00-{TRACE_ID:032x}-{c.context.span_id:016x}-01" for c in calls)
        for call in calls:
            assert call.name == "POST /completion" and call.attributes["http.response.status_code"] == 200
            assert call.attributes["url.full"].endswith("/completion")

    def test_an_unsampled_trace_is_still_forwarded(self, bundle):
        exporter = InMemorySpanExporter()
        client, fake = self.gateway(bundle, exporter, ["server.tracing.otlp_endpoint=http://127.0.0.1:9"])
        with client:
            unsampled = TRACEPARENT[:-2] + "00"
            client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers={"traceparent": unsampled})
        (forwarded,) = [headers["traceparent"] for headers in fake.headers]
        assert forwarded.startswith(f"00-{TRACE_ID:032x}-") and forwarded.endswith("-00")
        assert exporter.get_finished_spans() == ()

    def test_nothing_is_forwarded_when_tracing_is_off(self, bundle):
        client, fake = self.gateway(bundle, None, [])
        with client:
            client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers={"traceparent": TRACEPARENT})
        assert all("traceparent" not in headers for headers in fake.headers) and fake.headers


class OtlpReceiver:
    """A tiny OTLP/HTTP collector: POST /v1/traces with an ExportTraceServiceRequest (protobuf, maybe gzip)."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.requests: list = []
        self.paths: list[str] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                data = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    data = gzip.decompress(data)
                elif self.headers.get("Content-Encoding") == "deflate":
                    data = zlib.decompress(data)
                message = ExportTraceServiceRequest()
                message.ParseFromString(data)
                receiver.requests.append(message)
                receiver.paths.append(self.path)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def spans(self) -> list:
        return [
            span
            for message in self.requests
            for resource in message.resource_spans
            for scope in resource.scope_spans
            for span in scope.spans
        ]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_local_otlp_receiver_gets_the_spans(loaded_model):
    """Through the real OTLP/HTTP exporter, batched, flushed when the app stops."""
    receiver = OtlpReceiver()
    try:
        config = compose_config([f"server.tracing.otlp_endpoint={receiver.url}", "server.tracing.service_name=df-test"])
        front = EngineFront(LocalEngine(loaded_model), max_waiting=4, timeout_s=30, memo_entries=0)
        with TestClient(build_app(config, Services.from_engine(config, front))) as client:
            response = client.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
                headers={"traceparent": TRACEPARENT},
            )
            assert response.status_code == 200
        assert receiver.paths and set(receiver.paths) == {"/v1/traces"}
        spans = {span.name: span for span in receiver.spans()}
        root = spans["chat SmolLM2-135M-Instruct"]
        assert root.trace_id == TRACE_ID.to_bytes(16, "big") and root.parent_span_id == PARENT_ID.to_bytes(8, "big")
        attributes = {a.key: a.value for a in root.attributes}
        assert attributes["gen_ai.usage.output_tokens"].int_value == response.json()["usage"]["completion_tokens"]
        assert [v.string_value for v in attributes["gen_ai.response.finish_reasons"].array_value.values] == ["length"]
        assert {"queue", "prefill", "prefill chunk", "decode"} <= set(spans)
        assert all(s.trace_id == root.trace_id for s in spans.values())
        resource = {a.key: a.value.string_value for a in receiver.requests[0].resource_spans[0].resource.attributes}
        assert resource["service.name"] == "df-test"
    finally:
        receiver.close()


def test_the_traces_url():
    assert traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert traces_url("https://x.example/otlp/v1/traces") == "https://x.example/otlp/v1/traces"


OFF = """
import sys
from litestar.testing import TestClient
from deltafin.app import build_app
from deltafin.app.services import Services
from deltafin.testing import compose_config

def main():
    config = compose_config([])
    with TestClient(build_app(config, Services.load(config))) as client:
        response = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "stream": True},
                               headers={"traceparent": "TRACEPARENT"})
        assert response.status_code == 200
    loaded = sorted(m for m in sys.modules if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter", "opentelemetry.trace", "deltafin.app.tracing")))
    print("LOADED", loaded)

if __name__ == "__main__":
    main()
""".replace("TRACEPARENT", TRACEPARENT)


def test_nothing_of_opentelemetry_is_imported_when_off(tmp_path):
    """Off (the default), a request imports neither the SDK, its exporters, its trace API nor Deltafin's tracing
    module. (Litestar's app imports the bare OpenTelemetry API package and its semantic conventions at build,
    when they are installed, looking for its own OpenTelemetry plugin: its own, once.)"""
    script = tmp_path / "off.py"
    script.write_text(OFF)
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "LOADED []" in result.stdout
