"""Prometheus metrics, served at /metrics.

HTTP metrics are labelled by route *template* (`/v1/models/{name:str}`), never by the raw path: a label per
path let anyone grow /metrics and the process without bound by asking for random URLs. Paths that match no
route share one `unmatched` label; requests refused by the API-key check share `unauthenticated`. What a model
does (tokens, TTFT, memo and prefix-cache hits, its queue, its expert pool) is labelled by `model`: the served
name of the model the request went to (a process may serve several: deltafin.app.served), never the name the
request sent, so the config bounds the set.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

UNMATCHED = "unmatched"
UNAUTHENTICATED = "unauthenticated"

#: Latency buckets for token timings (seconds): a CPU decode step is ~50 ms, a GPU one ~10 ms.
_TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    def __init__(self) -> None:
        # A registry per app, so several apps in one process (tests) do not collide.
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "deltafin_requests", "HTTP requests by route template and status", ["route", "status"], registry=r
        )
        self.latency = Histogram("deltafin_request_seconds", "Request latency by route template", ["route"], registry=r)
        model = ["model"]
        self.prompt_tokens = Counter("deltafin_prompt_tokens", "Prompt tokens processed", model, registry=r)
        self.completion_tokens = Counter("deltafin_completion_tokens", "Completion tokens generated", model, registry=r)
        self.memo_hits = Counter(
            "deltafin_memo_hits", "Requests answered from the deterministic memo", model, registry=r
        )
        self.prefix_hits = Counter(
            "deltafin_prefix_cache_hits", "Requests that reused a cached prompt prefix", model, registry=r
        )
        self.cached_tokens = Counter(
            "deltafin_prefix_cache_tokens", "Prompt tokens served from the prefix cache", model, registry=r
        )
        self.spec_draft_tokens = Counter(
            "deltafin_spec_draft_tokens",
            "Tokens guessed by speculative decoding (engine.speculative)",
            model,
            registry=r,
        )
        self.spec_accepted_tokens = Counter(
            "deltafin_spec_accepted_tokens", "Guessed tokens the model kept (speculative decoding)", model, registry=r
        )
        self.ttft = Histogram(
            "deltafin_time_to_first_token_seconds", "Time to first token", model, buckets=_TOKEN_BUCKETS, registry=r
        )
        self.inter_token = Histogram(
            "deltafin_inter_token_seconds",
            "Mean time between output tokens, per request",
            model,
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.rule_firings = Counter(
            "deltafin_rule_firings", "Requests a compat rule changed, by rule", ["rule"], registry=r
        )
        # Gateway mode (an upstream engine): how long each upstream generation took, and what went wrong.
        self.upstream_seconds = Histogram(
            "deltafin_upstream_seconds", "Upstream generation time per choice", ["engine"], registry=r
        )
        self.upstream_errors = Counter(
            "deltafin_upstream_errors", "Upstream failures by kind", ["engine", "kind"], registry=r
        )

    def watch_engines(self, engines: Callable[[], list[tuple[str, float, float]]]) -> None:
        """Each loaded model's queue and state, read at scrape time (no bookkeeping on the request path):
        `engines()` gives (model, requests waiting, 1.0 while generating)."""
        self.registry.register(_EngineCollector(engines))

    def watch_expert_pools(self, pools: Callable[[], list[tuple[str, Any]]]) -> None:
        """The expert pools' counters, read at scrape time: `pools()` gives (model, PoolStats) for each loaded
        model that has a pool (none: no expert series at all)."""
        self.registry.register(_ExpertPoolCollector(pools))

    def watch_prefix_caches(self, caches: Callable[[], list[tuple[str, Any]]]) -> None:
        """The prefix caches' counters by tier (ram, disk), read at scrape time: `caches()` gives (model,
        TierStats) for each loaded model whose engine has a prefix cache of its own."""
        self.registry.register(_PrefixCacheCollector(caches))

    # The upstream engines' observer interface (deltafin.engine.upstream.engine.UpstreamObserver).
    def upstream_latency(self, engine: str, seconds: float) -> None:
        self.upstream_seconds.labels(engine=engine).observe(seconds)

    def upstream_error(self, engine: str, kind: str) -> None:
        self.upstream_errors.labels(engine=engine, kind=kind).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """deltafin_queue_depth and deltafin_engine_busy, one series per loaded model."""

    def __init__(self, engines: Callable[[], list[tuple[str, float, float]]]) -> None:
        self._engines = engines

    def describe(self) -> list:  # no series known before a model loads; keeps registration side-effect free
        return []

    def collect(self) -> Iterator[Any]:
        engines = self._engines()
        depth = GaugeMetricFamily("deltafin_queue_depth", "Requests waiting for the engine", labels=["model"])
        busy = GaugeMetricFamily("deltafin_engine_busy", "1 while the engine is generating", labels=["model"])
        for model, waiting, generating in engines:
            depth.add_metric([model], waiting)
            busy.add_metric([model], generating)
        yield depth
        yield busy


class _ExpertPoolCollector:
    """deltafin_expert_pool_* and deltafin_expert_bytes_read_total, from each model's pool when scraped."""

    #: (name, kind, help, value of a PoolStats)
    SERIES = (
        (
            "deltafin_expert_pool_hits",
            CounterMetricFamily,
            "Routed-expert lookups served by the pool (prefetched included)",
            lambda s: s.hits,
        ),
        (
            "deltafin_expert_pool_misses",
            CounterMetricFamily,
            "Routed-expert lookups that had to read the expert",
            lambda s: s.misses,
        ),
        (
            "deltafin_expert_bytes_read",
            CounterMetricFamily,
            "Bytes of routed experts read from the checkpoint (misses and prefetches)",
            lambda s: s.bytes_read,
        ),
        (
            "deltafin_expert_prefetch_reads",
            CounterMetricFamily,
            "Experts read ahead by prefetch",
            lambda s: s.prefetch_reads,
        ),
        (
            "deltafin_expert_prefetch_hits",
            CounterMetricFamily,
            "Prefetched experts used before being evicted",
            lambda s: s.prefetch_hits,
        ),
        (
            "deltafin_expert_read_wait_seconds",
            CounterMetricFamily,
            "Time the engine waited for expert reads",
            lambda s: s.wait_seconds,
        ),
        ("deltafin_expert_pool_slots", GaugeMetricFamily, "Expert slots in the pool", lambda s: s.slots),
        (
            "deltafin_expert_pool_occupancy",
            GaugeMetricFamily,
            "Fraction of the pool's slots holding an expert",
            lambda s: s.occupied / max(1, s.slots),
        ),
        (
            "deltafin_expert_pool_bytes",
            GaugeMetricFamily,
            "Bytes of the pool's slots",
            lambda s: s.slots * s.slot_bytes,
        ),
    )

    def __init__(self, pools: Callable[[], list[tuple[str, Any]]]) -> None:
        self._pools = pools

    def describe(self) -> list:  # no series known before the model loads; keeps registration side-effect free
        return []

    def collect(self) -> Iterator[Any]:
        pools = self._pools()
        if not pools:
            return
        for name, kind, help_text, value in self.SERIES:
            family = kind(name, help_text, labels=["model"])
            for model, stats in pools:
                family.add_metric([model], value(stats))
            yield family


class _PrefixCacheCollector:
    """deltafin_prefix_cache_* by tier, and the disk tier's I/O, from each model's prefix cache when scraped."""

    #: (name, kind, help, the value of a TierStats per tier)
    BY_TIER = (
        (
            "deltafin_prefix_cache_tier_hits",
            CounterMetricFamily,
            "Prompts that reused a prefix, by the tier that held it",
            "hits",
        ),
        (
            "deltafin_prefix_cache_tier_hit_tokens",
            CounterMetricFamily,
            "Prompt tokens reused, by the tier that held them",
            "hit_tokens",
        ),
        (
            "deltafin_prefix_cache_evictions",
            CounterMetricFamily,
            "Entries (ram) and block files (disk) evicted over budget",
            "evictions",
        ),
        (
            "deltafin_prefix_cache_bytes",
            GaugeMetricFamily,
            "Bytes each tier holds (disk: the whole folder)",
            "bytes_held",
        ),
        ("deltafin_prefix_cache_entries", GaugeMetricFamily, "Entries (ram) and block files (disk) held", "entries"),
    )
    #: (name, help, field of a TierStats) for the disk tier's counters
    DISK = (
        ("deltafin_prefix_cache_disk_read_seconds", "Seconds the disk tier spent reading hits", "disk_read_seconds"),
        (
            "deltafin_prefix_cache_disk_write_seconds",
            "Seconds the disk tier spent writing blocks",
            "disk_write_seconds",
        ),
        ("deltafin_prefix_cache_disk_read_bytes", "Bytes of blocks read back", "disk_bytes_read"),
        ("deltafin_prefix_cache_disk_written_bytes", "Bytes of blocks written", "disk_bytes_written"),
        (
            "deltafin_prefix_cache_disk_writes_dropped",
            "Block writes dropped because the writer's queue was full",
            "disk_writes_dropped",
        ),
        (
            "deltafin_prefix_cache_disk_write_failures",
            "Block writes that failed (a full disk, a folder gone or not writable)",
            "disk_write_failures",
        ),
        ("deltafin_prefix_cache_disk_files_removed", "Damaged or foreign block files removed", "disk_files_removed"),
    )

    def __init__(self, caches: Callable[[], list[tuple[str, Any]]]) -> None:
        self._caches = caches

    def describe(self) -> list:  # no series known before the model loads; keeps registration side-effect free
        return []

    def collect(self) -> Iterator[Any]:
        caches = self._caches()
        if not caches:
            return
        for name, kind, help_text, attribute in self.BY_TIER:
            family = kind(name, help_text, labels=["model", "tier"])
            for model, stats in caches:
                for tier, value in getattr(stats, attribute).items():
                    family.add_metric([model, tier], value)
            yield family
        for name, help_text, attribute in self.DISK:
            family = CounterMetricFamily(name, help_text, labels=["model"])
            for model, stats in caches:
                family.add_metric([model], getattr(stats, attribute))
            yield family
