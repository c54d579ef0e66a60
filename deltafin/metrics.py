"""Prometheus metrics, served at /metrics.

HTTP metrics are labelled by route *template* (`/v1/models/{name:str}`), never by the raw path: a label per
path let anyone grow /metrics and the process without bound by asking for random URLs. Paths that match no
route share one `unmatched` label; requests refused by the API-key check share `unauthenticated`.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

UNMATCHED = "unmatched"
UNAUTHENTICATED = "unauthenticated"

#: Latency buckets for token timings (seconds): a CPU decode step is ~50 ms, a GPU one ~10 ms.
_TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    def __init__(self) -> None:
        # A registry per app, so several apps in one process (tests) do not collide.
        self.registry = r = CollectorRegistry()
        self.requests = Counter("deltafin_requests", "HTTP requests by route template and status", ["route", "status"], registry=r)
        self.latency = Histogram("deltafin_request_seconds", "Request latency by route template", ["route"], registry=r)
        self.prompt_tokens = Counter("deltafin_prompt_tokens", "Prompt tokens processed", registry=r)
        self.completion_tokens = Counter("deltafin_completion_tokens", "Completion tokens generated", registry=r)
        self.memo_hits = Counter("deltafin_memo_hits", "Requests answered from the deterministic memo", registry=r)
        self.prefix_hits = Counter("deltafin_prefix_cache_hits", "Requests that reused a cached prompt prefix", registry=r)
        self.cached_tokens = Counter("deltafin_prefix_cache_tokens", "Prompt tokens served from the prefix cache", registry=r)
        self.ttft = Histogram("deltafin_time_to_first_token_seconds", "Time to first token", buckets=_TOKEN_BUCKETS, registry=r)
        self.inter_token = Histogram(
            "deltafin_inter_token_seconds", "Mean time between output tokens, per request", buckets=_TOKEN_BUCKETS, registry=r
        )
        self.rule_firings = Counter("deltafin_rule_firings", "Requests a compat rule changed, by rule", ["rule"], registry=r)
        self.queue_depth = Gauge("deltafin_queue_depth", "Requests waiting for the engine", registry=r)
        self.engine_busy = Gauge("deltafin_engine_busy", "1 while the engine is generating", registry=r)
        # Gateway mode (an upstream engine): how long each upstream generation took, and what went wrong.
        self.upstream_seconds = Histogram("deltafin_upstream_seconds", "Upstream generation time per choice", ["engine"], registry=r)
        self.upstream_errors = Counter("deltafin_upstream_errors", "Upstream failures by kind", ["engine", "kind"], registry=r)

    def watch_engine(self, queue_depth: Callable[[], float], busy: Callable[[], float]) -> None:
        """Read the engine's queue and state at scrape time (no bookkeeping on the request path)."""
        self.queue_depth.set_function(queue_depth)
        self.engine_busy.set_function(busy)

    def watch_expert_pool(self, stats: Callable[[], Any]) -> None:
        """The expert pool's counters, read at scrape time from `stats()` (a PoolStats, or None: no pool,
        and then no expert series at all)."""
        self.registry.register(_ExpertPoolCollector(stats))

    # The upstream engines' observer interface (deltafin.engine.upstream.engine.UpstreamObserver).
    def upstream_latency(self, engine: str, seconds: float) -> None:
        self.upstream_seconds.labels(engine=engine).observe(seconds)

    def upstream_error(self, engine: str, kind: str) -> None:
        self.upstream_errors.labels(engine=engine, kind=kind).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ExpertPoolCollector:
    """deltafin_expert_pool_* and deltafin_expert_bytes_read_total, from the engine's pool when scraped."""

    def __init__(self, stats: Callable[[], Any]) -> None:
        self._stats = stats

    def describe(self) -> list:  # no series known before the model loads; keeps registration side-effect free
        return []

    def collect(self) -> Iterator[Any]:
        stats = self._stats()
        if stats is None:
            return
        yield CounterMetricFamily("deltafin_expert_pool_hits", "Routed-expert lookups served by the pool (prefetched included)", value=stats.hits)
        yield CounterMetricFamily("deltafin_expert_pool_misses", "Routed-expert lookups that had to read the expert", value=stats.misses)
        yield CounterMetricFamily("deltafin_expert_bytes_read", "Bytes of routed experts read from the checkpoint (misses and prefetches)", value=stats.bytes_read)
        yield CounterMetricFamily("deltafin_expert_prefetch_reads", "Experts read ahead by prefetch", value=stats.prefetch_reads)
        yield CounterMetricFamily("deltafin_expert_prefetch_hits", "Prefetched experts used before being evicted", value=stats.prefetch_hits)
        yield CounterMetricFamily("deltafin_expert_read_wait_seconds", "Time the engine waited for expert reads", value=stats.wait_seconds)
        yield GaugeMetricFamily("deltafin_expert_pool_slots", "Expert slots in the pool", value=stats.slots)
        yield GaugeMetricFamily("deltafin_expert_pool_occupancy", "Fraction of the pool's slots holding an expert", value=stats.occupied / max(1, stats.slots))
        yield GaugeMetricFamily("deltafin_expert_pool_bytes", "Bytes of the pool's slots", value=stats.slots * stats.slot_bytes)
