"""Outermost ASGI layer: x-request-id on every response (404s too), one canonical log line, metrics."""

from __future__ import annotations

import time
import uuid
from typing import Any

import structlog

from deltafin.metrics import Metrics
from deltafin.serving.context import RequestStats

log = structlog.get_logger("deltafin.access")

STATS_KEY = "deltafin_stats"


def _header(scope: dict[str, Any], name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


class RequestContext:
    def __init__(self, app: Any, metrics: Metrics, engine: str = "local") -> None:
        self.app = app
        self.metrics = metrics
        self.engine = engine

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _header(scope, b"x-request-id") or uuid.uuid4().hex
        stats = RequestStats()
        scope.setdefault("state", {})[STATS_KEY] = stats
        status = 500
        done = False

        async def send_with_context(message: dict[str, Any]) -> None:
            nonlocal status, done
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", []))
                headers.append((b"x-request-id", request_id.encode("latin-1")))
                if stats.rules:
                    headers.append((b"x-deltafin-rules", ",".join(stats.rules).encode("latin-1")))
                message = {**message, "headers": headers}
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                done = True
            await send(message)

        structlog.contextvars.bind_contextvars(request_id=request_id)
        try:
            await self.app(scope, receive, send_with_context)
        finally:
            self._log(scope, stats, status, completed=done)
            structlog.contextvars.unbind_contextvars("request_id")

    def _log(self, scope: dict[str, Any], stats: RequestStats, status: int, *, completed: bool) -> None:
        route = scope.get("path", "")
        total = time.perf_counter() - stats.started
        self.metrics.requests.labels(route=route, status=str(status)).inc()
        self.metrics.latency.labels(route=route).observe(total)
        self.metrics.prompt_tokens.inc(stats.prompt_tokens)
        self.metrics.completion_tokens.inc(stats.completion_tokens)
        if stats.memo_hit:
            self.metrics.memo_hits.inc()
        if stats.ttft_s is not None:
            self.metrics.ttft.observe(stats.ttft_s)
        log.info(
            "request",
            method=scope.get("method"),
            route=route,
            status=status,
            engine=self.engine,
            completed=completed,
            prompt_tokens=stats.prompt_tokens,
            completion_tokens=stats.completion_tokens,
            cached_tokens=stats.cached_tokens,
            queue_wait_ms=_ms(stats.queue_wait_s),
            ttft_ms=_ms(stats.ttft_s),
            prefill_ms=_ms(stats.prefill_s),
            total_ms=round(total * 1000, 2),
            memo_hit=stats.memo_hit,
            finish_reasons=stats.finish_reasons or None,
            rules=stats.rules,
        )


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)
