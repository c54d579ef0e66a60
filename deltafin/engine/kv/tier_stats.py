"""The prefix cache's counters by tier, read by /metrics at scrape time (no bookkeeping on the request path)."""

from __future__ import annotations

from dataclasses import dataclass, field

TIERS = ("ram", "disk")


@dataclass
class TierStats:
    """Written by the engine's owner thread and the disk tier's threads (one writer per field); read whole by
    the metrics collector."""

    hits: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    hit_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    bytes_held: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    entries: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    evictions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    #: seconds the disk tier's threads spent reading (hits) and writing blocks
    disk_read_seconds: float = 0.0
    disk_write_seconds: float = 0.0
    disk_bytes_read: int = 0
    disk_bytes_written: int = 0
    #: block writes left out because the writer's queue was full (the engine never waits for it)
    disk_writes_dropped: int = 0
    #: block writes that failed (a full disk, a folder gone or not writable)
    disk_write_failures: int = 0
    #: damaged, truncated or foreign block files found on a read and removed
    disk_files_removed: int = 0
