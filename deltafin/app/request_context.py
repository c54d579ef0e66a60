"""Outermost ASGI layer: x-request-id on every response (404s too; Anthropic's `request-id` too on its routes),
one canonical log line, metrics, and the request's trace when tracing is on (deltafin.app.tracing)."""

from __future__ import annotations

import os
import re
import time
from typing import Any

import structlog

from deltafin.app.errors import REQUEST_ID_KEY, speaks_anthropic
from deltafin.metrics import UNMATCHED, Metrics
from deltafin.serving.context import RequestStats

log = structlog.get_logger("deltafin.access")

STATS_KEY = "deltafin_stats"
#: Set by an ASGI layer that answers before routing (the API-key gate) to label its requests.
ROUTE_KEY = "deltafin_route"

#: A client's x-request-id is echoed and logged only if it looks like an id; anything else (64 KB, control
#: characters, spaces) is replaced by our own, so a client cannot inflate responses or forge log fields.
_CLIENT_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:\-]{1,128}")
#: The raw path is logged as `route` (it is never a metric label), cut to this length.
_MAX_LOGGED_PATH = 256


def request_id_of(scope: dict[str, Any]) -> str:
    for key, value in scope.get("headers", ()):
        if key.lower() == b"x-request-id":
            if _CLIENT_REQUEST_ID.fullmatch(value):
                return value.decode("ascii")
            break
    return os.urandom(16).hex()  # as random as uuid4().hex, without building a UUID (~1.4 us)


def route_template(scope: dict[str, Any]) -> str:
    """The matched route's template, or one shared label for everything that matched nothing."""
    return scope.get(ROUTE_KEY) or scope.get("path_template") or UNMATCHED


class RequestContext:
    def __init__(self, app: Any, metrics: Metrics, engine: str = "local", tracer: Any = None) -> None:
        self.app = app
        self.metrics = metrics
        self.drain: Any = None  # set by build_app
        self.engine = engine
        #: deltafin.app.tracing.RequestTracer when server.tracing is on (typed Any: that module imports the SDK)
        self.tracer = tracer

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_of(scope)
        stats = RequestStats()
        state = scope.setdefault("state", {})
        state[STATS_KEY] = stats
        # Anthropic's clients read `request-id` (its SDK's `_request_id`), with a `req_` prefix.
        anthropic_id = f"req_{request_id}" if speaks_anthropic(scope.get("path", "")) else None
        if anthropic_id is not None:
            state[REQUEST_ID_KEY] = anthropic_id
        status = 500
        done = False

        async def send_with_context(message: dict[str, Any]) -> None:
            nonlocal status, done
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", []))
                headers.append((b"x-request-id", request_id.encode("ascii")))
                if anthropic_id is not None:
                    headers.append((b"request-id", anthropic_id.encode("ascii")))
                if stats.rules:
                    headers.append((b"x-deltafin-rules", ",".join(stats.rules).encode("latin-1")))
                headers += [(name.encode("latin-1"), value.encode("latin-1")) for name, value in stats.headers]
                message = {**message, "headers": headers}
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                done = True
            await send(message)

        structlog.contextvars.bind_contextvars(request_id=request_id)
        traced = self.tracer.start(scope, request_id) if self.tracer is not None else None
        try:
            await self.app(scope, receive, send_with_context)
        finally:
            total = self._log(scope, stats, status, completed=done)
            if traced is not None:
                self.tracer.finish(traced, stats, status, total_s=total, completed=done)
            structlog.contextvars.unbind_contextvars("request_id")

    def _observe(self, route: str, stats: RequestStats, status: int, total: float) -> None:
        m = self.metrics
        m.requests.labels(route=route, status=str(status)).inc()
        m.latency.labels(route=route).observe(total)
        if stats.model is not None:  # a request that reached a model (labelled by its served name)
            model = stats.model
            m.prompt_tokens.labels(model=model).inc(stats.prompt_tokens)
            m.completion_tokens.labels(model=model).inc(stats.generated_tokens)
            if stats.memo_hit:
                m.memo_hits.labels(model=model).inc()
            if stats.cached_tokens:
                m.prefix_hits.labels(model=model).inc()
                m.cached_tokens.labels(model=model).inc(stats.cached_tokens)
            if stats.spec_draft_tokens:
                m.spec_draft_tokens.labels(model=model).inc(stats.spec_draft_tokens)
                m.spec_accepted_tokens.labels(model=model).inc(stats.spec_accepted_tokens)
            if stats.ttft_s is not None:
                m.ttft.labels(model=model).observe(stats.ttft_s)
                if stats.generated_tokens > 1:
                    m.inter_token.labels(model=model).observe(
                        max(0.0, total - stats.ttft_s) / (stats.generated_tokens - 1)
                    )
        for rule in stats.rules:  # rule names come from the config, so this label set is bounded
            m.rule_firings.labels(rule=rule).inc()

    def _log(self, scope: dict[str, Any], stats: RequestStats, status: int, *, completed: bool) -> float:
        """Log and count the request; its total time in seconds."""
        route = route_template(scope)
        total = time.perf_counter() - stats.started
        self._observe(route, stats, status, total)
        log.info(
            "request",
            method=scope.get("method"),
            route=scope.get("path", "")[:_MAX_LOGGED_PATH],  # the path asked for
            route_template=route,  # what metrics are labelled with
            status=status,
            model=stats.model,
            engine=stats.engine or self.engine,
            completed=completed,
            prompt_tokens=stats.prompt_tokens,
            completion_tokens=stats.generated_tokens,
            cached_tokens=stats.cached_tokens,
            queue_wait_ms=_ms(stats.queue_wait_s),
            ttft_ms=_ms(stats.ttft_s),
            prefill_ms=_ms(stats.prefill_s),
            total_ms=round(total * 1000, 2),
            memo_hit=stats.memo_hit,
            finish_reasons=stats.finish_reasons or None,
            rules=stats.rules,
            **stats.expert_fields(),
            **stats.spec_fields(),
        )
        return total


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)
