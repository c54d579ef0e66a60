"""OpenTelemetry traces of generation requests (`server.tracing`; `pip install deltafin[tracing]`).

One server span per generation request (chat, completions, Responses and every route served as one), named as
the GenAI semantic conventions name an inference span (`chat MODEL`, `text_completion MODEL`), with their
attributes: `gen_ai.operation.name`, `gen_ai.request.model` / `gen_ai.response.model` (the served name), the
request's sampling (`gen_ai.request.temperature`, `top_p`, `top_k`, `max_tokens`, penalties, `seed`,
`choice.count`), `gen_ai.usage.input_tokens` / `output_tokens` / `cache_read.input_tokens`,
`gen_ai.response.finish_reasons`, and latencies as vLLM names them (`gen_ai.latency.time_to_first_token`,
`time_in_queue`, `e2e`). Under it, what the engine marked (deltafin.engine.timeline): the queue wait, each
prompt's prefill with its chunks, each choice's decode, each upstream call (a client span whose id is the one its
`traceparent` sent, so the upstream's spans hang under it). An incoming W3C `traceparent` is continued (and its
sampled flag followed; new traces are sampled at `sample_ratio`).

Spans are written when the request ends, from the marks, with their own start and end times: nothing is done per
token, and the engine never sees OpenTelemetry. This module is imported only when `otlp_endpoint` is set; spans
leave in batches, from the SDK's own thread, to the collector over OTLP/HTTP (protobuf).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from deltafin import __version__
from deltafin.config.schema import TracingConfig
from deltafin.engine.timeline import Mark, Timeline, current_timeline
from deltafin.serving.context import RequestStats

_PROPAGATOR = TraceContextTextMapPropagator()
_KINDS = {"internal": SpanKind.INTERNAL, "client": SpanKind.CLIENT}
#: SamplingParams field -> its GenAI request attribute
_REQUEST_ATTRIBUTES = {
    "temperature": "gen_ai.request.temperature",
    "top_p": "gen_ai.request.top_p",
    "top_k": "gen_ai.request.top_k",
    "max_tokens": "gen_ai.request.max_tokens",
    "presence_penalty": "gen_ai.request.presence_penalty",
    "frequency_penalty": "gen_ai.request.frequency_penalty",
    "seed": "gen_ai.request.seed",
}


def traces_url(endpoint: str) -> str:
    """OTLP/HTTP's traces URL: a bare collector address gets the signal's path (`/v1/traces`), as
    OTEL_EXPORTER_OTLP_ENDPOINT does; a URL with a path is used as it is (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)."""
    return endpoint.rstrip("/") + "/v1/traces" if urlsplit(endpoint).path in ("", "/") else endpoint


class _PresetIds(RandomIdGenerator):
    """Random ids, but the one a span must have when its id is already out (an upstream call's traceparent)."""

    def __init__(self) -> None:
        self._preset: ContextVar[int | None] = ContextVar("deltafin_preset_span_id", default=None)

    @contextlib.contextmanager
    def preset(self, span_id: int | None) -> Iterator[None]:
        token = self._preset.set(span_id)
        try:
            yield
        finally:
            self._preset.reset(token)

    def generate_span_id(self) -> int:
        preset = self._preset.get()
        return preset if preset is not None else super().generate_span_id()


@dataclass
class RequestTrace:
    """One traced request: its span, and the timeline the engine marks."""

    span: Any
    timeline: Timeline
    operation: str
    token: Any = None


class RequestTracer:
    """Traces the requests to `paths` (the generation routes); `exporter`: where spans go (None: OTLP/HTTP to
    `config.otlp_endpoint`, in batches; tests pass an in-memory one, exported span by span)."""

    def __init__(self, config: TracingConfig, paths: frozenset[str], exporter: SpanExporter | None = None) -> None:
        self.paths = paths
        self._ids = _PresetIds()
        self.provider = TracerProvider(
            sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
            resource=Resource.create({"service.name": config.service_name, "service.version": __version__}),
            id_generator=self._ids,
        )
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            assert config.otlp_endpoint is not None
            self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(traces_url(config.otlp_endpoint))))
        else:
            self.provider.add_span_processor(SimpleSpanProcessor(exporter))
        self._tracer = self.provider.get_tracer("deltafin", __version__)

    def start(self, scope: dict[str, Any], request_id: str) -> RequestTrace | None:
        """The request's span (continuing the trace its `traceparent` names), its timeline set for the engine;
        None for a path that is not a generation route."""
        path = "/" + "/".join(part for part in scope.get("path", "").split("/") if part)
        if path not in self.paths:
            return None
        carrier = {
            key.decode("latin-1"): value.decode("latin-1")
            for key, value in scope.get("headers", ())
            if key in (b"traceparent", b"tracestate")
        }
        parent = _PROPAGATOR.extract(carrier) if carrier else None
        operation = "text_completion" if path.endswith("/completions") and "chat" not in path else "chat"
        span = self._tracer.start_span(
            operation,
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                "gen_ai.operation.name": operation,
                "http.request.method": scope.get("method", ""),
                "url.path": path,
                "deltafin.request_id": request_id,
            },
        )
        context = span.get_span_context()
        timeline = Timeline(
            context.trace_id,
            context.span_id,
            sampled=context.trace_flags.sampled,
            trace_state=context.trace_state.to_header(),
        )
        trace_handle = RequestTrace(span, timeline, operation)
        trace_handle.token = current_timeline.set(timeline)
        return trace_handle

    def finish(
        self, handle: RequestTrace, stats: RequestStats, status: int, *, total_s: float, completed: bool
    ) -> None:
        """End the request's span with what serving counted, and write the engine's marks under it."""
        current_timeline.reset(handle.token)
        span, timeline = handle.span, handle.timeline
        if not span.is_recording():
            span.end()
            return
        if stats.model is not None:
            span.update_name(f"{handle.operation} {stats.model}")
        span.set_attributes(_request_attributes(timeline))
        span.set_attributes(
            {
                "gen_ai.request.model": stats.model or "",
                "gen_ai.response.model": stats.model or "",
                "gen_ai.usage.input_tokens": stats.prompt_tokens,
                "gen_ai.usage.output_tokens": stats.generated_tokens,
                "gen_ai.usage.cache_read.input_tokens": stats.cached_tokens,
                "gen_ai.response.finish_reasons": tuple(stats.finish_reasons),
                "gen_ai.latency.e2e": total_s,
                "http.response.status_code": status,
                "deltafin.completed": completed,
                "deltafin.memo_hit": stats.memo_hit,
                "deltafin.rules": tuple(stats.rules),
            }
        )
        if stats.ttft_s is not None:
            span.set_attribute("gen_ai.latency.time_to_first_token", stats.ttft_s)
        if stats.queue_wait_s is not None:
            span.set_attribute("gen_ai.latency.time_in_queue", stats.queue_wait_s)
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
            span.set_attribute("error.type", str(status))
        parent = trace.set_span_in_context(span)
        for mark in list(timeline.marks):
            self._write(mark, parent)
        span.end()

    def _write(self, mark: Mark, parent: Context) -> None:
        with self._ids.preset(mark.span_id):
            span = self._tracer.start_span(
                mark.name,
                context=parent,
                kind=_KINDS.get(mark.kind, SpanKind.INTERNAL),
                start_time=mark.start_ns,
                attributes=mark.attributes,
            )
        context = trace.set_span_in_context(span)
        for child in mark.children:
            self._write(child, context)
        span.end(end_time=mark.end_ns)

    def flush(self) -> None:
        self.provider.force_flush()

    def shutdown(self) -> None:
        """Send what is still batched, then stop (at the server's exit)."""
        self.provider.shutdown()


def _request_attributes(timeline: Timeline) -> dict[str, Any]:
    params = timeline.params
    if params is None:  # refused before it reached the engine
        return {}
    found = {name: getattr(params, field) for field, name in _REQUEST_ATTRIBUTES.items()}
    found = {name: value for name, value in found.items() if value is not None}
    found["gen_ai.request.choice.count"] = timeline.choices
    return found
