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

    def render(self) -> bytes:
        return generate_latest(self.registry)
