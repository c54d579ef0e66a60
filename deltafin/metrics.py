"""Prometheus counters for requests and tokens, served at /metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest


class Metrics:
    def __init__(self) -> None:
        # A registry per app, so several apps in one process (tests) do not collide.
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "deltafin_requests", "HTTP requests by route and status", ["route", "status"], registry=self.registry
        )
        self.prompt_tokens = Counter("deltafin_prompt_tokens", "Prompt tokens processed", registry=self.registry)
        self.completion_tokens = Counter("deltafin_completion_tokens", "Completion tokens generated", registry=self.registry)
        self.memo_hits = Counter("deltafin_memo_hits", "Requests answered from the deterministic memo", registry=self.registry)
        self.latency = Histogram("deltafin_request_seconds", "Request latency", ["route"], registry=self.registry)
        self.ttft = Histogram("deltafin_time_to_first_token_seconds", "Time to first token", registry=self.registry)
        # Gateway mode (an upstream engine): how long each upstream generation took, and what went wrong.
        self.upstream_seconds = Histogram(
            "deltafin_upstream_seconds", "Upstream generation time per choice", ["engine"], registry=self.registry
        )
        self.upstream_errors = Counter(
            "deltafin_upstream_errors", "Upstream failures by kind", ["engine", "kind"], registry=self.registry
        )

    # The upstream engines' observer interface (deltafin.engine.upstream.engine.UpstreamObserver).
    def upstream_latency(self, engine: str, seconds: float) -> None:
        self.upstream_seconds.labels(engine=engine).observe(seconds)

    def upstream_error(self, engine: str, kind: str) -> None:
        self.upstream_errors.labels(engine=engine, kind=kind).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
