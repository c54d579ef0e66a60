"""Reuse of earlier prompts' and generations' caches when a new prompt shares their start (multi-turn chat,
agents), in two tiers: RAM under a byte budget, and disk (`disk_tier`), which outlives the process.

RAM holds entries: one row's cache, the token ids it holds, the cache scope it belongs to (`GenerationJob.
cache_scope`: "" for everyone, or an API key's digest) and, for a model with state layers, its checkpoint book
(`checkpoints`). A prompt takes the entry that gives it the longest reusable prefix in its scope (ties: the most
recent):
- attention positions are a list: any shared prefix is reusable;
- a state stands for exactly the tokens it saw: an entry is reusable up to its whole length when all of it starts
  the prompt, else up to its last checkpoint within the shared part (the attention positions cut to it).
At least one prompt token is always left to run (its logits start the answer). A prompt that uses all of an
entry takes the entry itself (no copy: `SOLE_OWNER`, the native step appends in place); one that uses part of
it gets views of the shared positions and the entry stays for other prompts, unless what it does not share is
shorter than `min_tokens` (not worth keeping: it is cut back and handed out).

Entries come back when a request's prompt is in (right after its prefill) and when each of its rows leaves (EOS,
stop, length, cancel). An entry whose tokens all start the new one is folded into it (its checkpoints, and its
final state as a checkpoint at its length, join the new entry's book). The bytes of every entry's tensors and
of the checkpoints (each counted once) stay under `max_bytes`: past it, entries leave by recency, those never
reused first (a segmented LRU: an entry a later prompt took once, and what that prompt gave back, is protected
over one-off prompts). With a disk tier, each entry's full blocks are queued for writing as it arrives (write-
through: a restart or a crash loses only what was still queued) and again when it leaves RAM; a prompt whose
prefix the disk holds at least a block further than RAM reads it back on the disk tier's reader thread while
the engine runs its other rows, then prefills the rest.

Only the engine's owner thread calls into this class; the disk tier's threads call back through `Reuse`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from deltafin.engine.kv import cache_layers
from deltafin.engine.kv.checkpoints import Capture, CheckpointBook, attach, book_of
from deltafin.engine.kv.disk_tier import DiskPlan, DiskSettings, DiskTier, Loaded, WriteGuard
from deltafin.engine.kv.tier_stats import TierStats

#: attribute set (True) on every cache `take` hands out whose storage nothing else references past its length, so
#: a forward may append there in place instead of copying the whole cache to new buffers (the native step does:
#: deltafin.engine.llama.native). Withheld from views of an entry that stays in RAM, and from an entry cut back
#: while the disk tier still has to copy blocks of its tail.
SOLE_OWNER = "deltafin_sole_owner"
#: attribute on a cache handed out from an entry: how often that entry's tokens were reused, so what the prompt
#: gives back keeps its protection from eviction
REUSED = "deltafin_reused"
#: positions of spare room behind a prefix read from disk, so the prompt's own positions append in place
APPEND_ROOM = 256
#: an entry whose storage exceeds its positions' bytes by more than this fraction (and 1 MiB) is copied to its
#: own size when kept (a row's view of a whole batch's buffers)
_SLACK = 0.25


@dataclass(frozen=True)
class PrefixCacheSettings:
    enabled: bool = True  # false: nothing is stored, nothing reused
    min_tokens: int = 16  # shorter shared prefixes are recomputed
    max_bytes: int = 2 << 30  # RAM for entries (attention positions, states, checkpoints)
    state_every_tokens: int | None = 512  # checkpoint interval of state layers' states during prefill
    disk: DiskSettings | None = None


@dataclass(eq=False)
class Entry:
    cache: Any
    ids: np.ndarray
    scope: str
    book: CheckpointBook | None
    nbytes: int  # the cache's own tensors (checkpoints are counted apart: entries share them)
    guard: WriteGuard
    reused: int = 0
    used: int = 0

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(eq=False)
class Reuse:
    """What `take` decided for a prompt. `ready` is False while a disk read runs; then `settle` (on the engine's
    thread) gives the cache and how many prompt tokens it holds."""

    ids: np.ndarray
    scope: str
    cache: Any = None
    cached: int = 0
    tier: str | None = None
    plan: DiskPlan | None = None
    loaded: Loaded | None = None
    ready: bool = True


class PrefixCache:
    def __init__(
        self,
        new_cache: Callable[[], Any],
        settings: PrefixCacheSettings = PrefixCacheSettings(),
        *,
        device: torch.device | None = None,
        wake: Callable[[], None] | None = None,
    ) -> None:
        """`new_cache()`: an empty cache of the model's layer kinds; `wake()`: called from the disk tier's reader
        thread when a read is done, so an idle engine looks again."""
        self._new_cache = new_cache
        self.settings = settings
        self._min_reuse = settings.min_tokens
        self._device = device
        self._wake = wake or (lambda: None)
        self.stats = TierStats()
        self._entries: list[Entry] = []
        self._captures: dict[int, list[Any]] = {}  # id -> [Capture, entries holding it]
        self._bytes = 0
        self._tick = 0
        template = new_cache() if settings.enabled else None
        layers = getattr(template, "layers", [])
        self._stateful = any(cache_layers.has_states(layer) for layer in layers)
        self._every = settings.state_every_tokens if self._stateful else None
        self._disk: DiskTier | None = None
        if settings.enabled and settings.disk is not None:
            self._disk = DiskTier(settings.disk, self.stats, [_kind(layer) for layer in layers])

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def entries(self) -> list[Entry]:
        return list(self._entries)

    @property
    def bytes_held(self) -> int:
        return self._bytes

    # --- taking ---

    def take(self, prompt_ids: Sequence[int], scope: str = "") -> Reuse:
        """The reuse for a prompt: settled at once from RAM (or nothing), or a disk read under way."""
        ids = np.asarray(prompt_ids, dtype=np.int64)
        reuse = Reuse(ids, scope)
        if not self.settings.enabled or len(ids) < 2:
            return self._settled(reuse, self._fresh(), 0, None)
        limit = len(ids) - 1  # at least one prompt token must run to get the next logits
        entry, usable = self._best(ids, scope, limit)
        if self._disk is not None:
            block = self._disk.block
            floor = max(self._min_reuse, usable + block)
            if (limit // block) * block >= floor:
                plan = self._disk.probe(ids, scope, limit, self._stateful, len(ids) + APPEND_ROOM)
                if plan is not None and plan.positions >= floor:
                    reuse.plan, reuse.ready = plan, False
                    self._disk.load(plan, lambda loaded: self._loaded(reuse, loaded))
                    return reuse
        return self._from_ram(reuse, entry, usable)

    def settle(self, reuse: Reuse) -> tuple[Any, int]:
        """(cache, cached tokens) of a ready reuse; a disk read's buffers become the cache here."""
        if reuse.cache is None:
            loaded, reuse.plan, reuse.loaded = reuse.loaded, None, None
            if loaded is not None and loaded.positions >= self._min_reuse:
                self._settled(reuse, self._from_disk(loaded), loaded.positions, "disk")
            else:  # the read found less than it hoped (a file evicted or damaged since): RAM, as now
                limit = len(reuse.ids) - 1
                entry, usable = self._best(reuse.ids, reuse.scope, limit)
                self._from_ram(reuse, entry, usable)
        return reuse.cache, reuse.cached

    def _loaded(self, reuse: Reuse, loaded: Loaded | None) -> None:  # the reader thread
        reuse.loaded = loaded
        reuse.ready = True
        self._wake()

    def _best(self, ids: np.ndarray, scope: str, limit: int) -> tuple[Entry | None, int]:
        best, usable = None, 0
        for entry in self._entries:
            if entry.scope != scope:
                continue
            n = self._reusable(entry, ids, limit)
            if n > usable or (n == usable and n and best is not None and entry.used > best.used):
                best, usable = entry, n
        return best, usable

    def _reusable(self, entry: Entry, ids: np.ndarray, limit: int) -> int:
        common = min(_common_prefix(entry.ids, ids), limit)
        if not self._stateful:
            return common
        if common == len(entry):
            return common
        return entry.book.best(common) if entry.book is not None else 0

    def _from_ram(self, reuse: Reuse, entry: Entry | None, usable: int) -> Reuse:
        if entry is None or usable < self._min_reuse:
            return self._settled(reuse, self._fresh(), 0, None)
        self._tick += 1
        entry.reused += 1
        entry.used = self._tick
        states = None
        if self._stateful and usable < len(entry):
            assert entry.book is not None
            states = entry.book.at[usable].states
        carried = self._carried(entry, usable)
        if usable == len(entry):  # the whole entry: handed out as it is
            self._remove(entry)
            cache, sole = entry.cache, True
        elif len(entry) - usable < self._min_reuse:  # a tail not worth keeping: cut back and handed out
            self._remove(entry)
            cache = entry.cache
            cache_layers.crop_attention(cache, usable)
            if states is not None:
                cache_layers.set_states(cache, states)
            sole = entry.guard.pending == 0  # the disk tier may still copy positions past `usable`
        else:  # the entry stays: the prompt starts from views of its shared positions
            cache, sole = cache_layers.prefix_of(entry.cache, usable, states), False
        if carried is not None:
            attach(cache, carried)
        setattr(cache, REUSED, entry.reused)
        if sole:
            setattr(cache, SOLE_OWNER, True)
        elif getattr(cache, SOLE_OWNER, False):
            setattr(cache, SOLE_OWNER, False)
        return self._settled(reuse, cache, usable, "ram")

    def _carried(self, entry: Entry, usable: int) -> CheckpointBook | None:
        """The book the prompt's cache carries on: the entry's checkpoints up to where it starts."""
        if not self._stateful:
            return None
        book = entry.book if entry.book is not None else CheckpointBook(self._every)
        return CheckpointBook(self._every, book.upto(usable))

    def _from_disk(self, loaded: Loaded) -> Any:
        cache = self._new_cache()
        kv = loaded.kv
        if self._device is not None and self._device.type != "cpu":
            kv = {i: (k.to(self._device), v.to(self._device)) for i, (k, v) in kv.items()}
        captures = {p: _on_device(states, self._device) for p, states in loaded.captures.items()}
        cache_layers.fill(cache, kv, loaded.positions, captures.get(loaded.positions))
        if self._stateful:
            attach(cache, CheckpointBook(self._every, {p: Capture.of_states(s) for p, s in captures.items()}))
        setattr(cache, SOLE_OWNER, True)
        setattr(cache, REUSED, 1)
        return cache

    def _fresh(self) -> Any:
        cache = self._new_cache()
        if self._stateful:
            attach(cache, CheckpointBook(self._every))
        return cache

    def _settled(self, reuse: Reuse, cache: Any, cached: int, tier: str | None) -> Reuse:
        reuse.cache, reuse.cached, reuse.tier, reuse.ready = cache, cached, tier, True
        if tier is not None:
            self.stats.hits[tier] += 1
            self.stats.hit_tokens[tier] += cached
        return reuse

    # --- giving back ---

    def give_back(self, cache: Any, ids: Sequence[int], scope: str = "") -> None:
        """Offers `cache` (holding exactly `ids`) to later prompts of `scope`."""
        if not self.settings.enabled or not len(ids):
            return
        arr = np.asarray(ids, dtype=np.int64)
        if cache_layers.attention_length(cache) != len(arr):
            return  # not the cache of these tokens (nothing the engine gives back; never stored)
        book = book_of(cache)
        if self._stateful and book is None:
            book = CheckpointBook(self._every)
        reused = getattr(cache, REUSED, 0)
        for entry in list(self._entries):
            if entry.scope != scope:
                continue
            common = _common_prefix(entry.ids, arr)
            if common == len(entry):  # all of it starts the new one: folded in
                if book is not None:
                    if entry.book is not None:
                        for position, capture in entry.book.at.items():
                            book.at.setdefault(position, capture)
                    if len(entry) not in book.at and len(entry) < len(arr):
                        book.at[len(entry)] = Capture.of(entry.cache, copy=False)
                reused = max(reused, entry.reused)
                self._remove(entry)
            elif book is not None and entry.book is not None and common >= self._min_reuse:
                for position, capture in entry.book.upto(common).items():  # shared, never written again
                    book.at.setdefault(position, capture)
        if book is not None:
            _thin(book)
        tensors = cache_layers.cache_tensors(cache)
        held, wanted = cache_layers.storage_bytes(tensors), cache_layers.logical_bytes(tensors)
        if held > wanted + max(wanted * _SLACK, 1 << 20):
            cache_layers.compact(cache)
            held = cache_layers.storage_bytes(cache_layers.cache_tensors(cache))
        if getattr(cache, SOLE_OWNER, False):
            setattr(cache, SOLE_OWNER, False)
        self._tick += 1
        entry = Entry(cache, arr, scope, book, held, WriteGuard(), reused=reused, used=self._tick)
        self._add(entry)
        self._store(entry)
        while self._bytes > self.settings.max_bytes and self._entries:
            victim = min(self._entries, key=lambda e: (e.reused > 0, e.used))
            self._remove(victim)
            self.stats.evictions["ram"] += 1
            self._store(victim)  # blocks the writer's queue left out before

    def _store(self, entry: Entry) -> None:
        if self._disk is None:
            return
        captures = {p: c.states for p, c in entry.book.at.items()} if entry.book is not None else {}
        self._disk.store(entry.ids, entry.scope, cache_layers.attention_tensors(entry.cache), captures, entry.guard)

    # --- bookkeeping ---

    def _add(self, entry: Entry) -> None:
        self._entries.append(entry)
        self._bytes += entry.nbytes
        if entry.book is not None:
            for capture in entry.book.at.values():
                held = self._captures.setdefault(id(capture), [capture, 0])
                if held[1] == 0:
                    self._bytes += capture.nbytes
                held[1] += 1
        self._publish()

    def _remove(self, entry: Entry) -> None:
        self._entries.remove(entry)
        self._bytes -= entry.nbytes
        if entry.book is not None:
            for capture in entry.book.at.values():
                held = self._captures.get(id(capture))
                if held is None:
                    continue
                held[1] -= 1
                if held[1] == 0:
                    del self._captures[id(capture)]
                    self._bytes -= capture.nbytes
        self._publish()

    def _publish(self) -> None:
        self.stats.bytes_held["ram"] = self._bytes
        self.stats.entries["ram"] = len(self._entries)

    def clear(self) -> None:
        for entry in list(self._entries):
            self._remove(entry)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Waits for the disk tier's queued writes (True at once without a disk tier)."""
        return self._disk.flush(timeout_s) if self._disk is not None else True

    def close(self, wait_s: float = 10.0) -> None:
        """Stops the disk tier's threads, letting queued writes finish for up to `wait_s`."""
        if self._disk is not None:
            self._disk.close(wait_s)


def _thin(book: CheckpointBook) -> None:
    """Keeps, between two periodic checkpoints, only the latest of the others (the ends of earlier prompts and
    answers): an agent's conversation adds one per turn, and only the last is likely to be the point a
    rewritten turn leaves from."""
    if not book.every:
        return
    latest: dict[int, int] = {}
    for position in book.at:
        if position % book.every:
            span = position // book.every
            latest[span] = max(latest.get(span, 0), position)
    for position in list(book.at):
        if position % book.every and latest[position // book.every] != position:
            del book.at[position]


def _kind(layer: Any) -> str:
    kv, states = cache_layers.has_kv(layer), cache_layers.has_states(layer)
    return "both" if kv and states else "kv" if kv else "state" if states else "none"


def _on_device(states: list[Any], device: torch.device | None) -> list[Any]:
    """Captures read from disk, moved to the engine's device (and saying so)."""
    out: list[Any] = []
    for captured in states:
        if captured is None:
            out.append(None)
            continue
        tables, facts = captured
        if device is not None:
            tables = {key: t.to(device) for key, t in tables.items()}
        out.append((tables, {**facts, "device": device if device is not None else torch.device("cpu")}))
    return out


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n
