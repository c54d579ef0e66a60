"""The expert pool: which expert sits in which slot, reads on a miss, prefetch, eviction, counters.

Everything here runs on the thread that runs the model (the engine's owner thread), except the reads, which
run on the read queue's threads and touch only the slot they fill. One experts call (one MoE layer of one
forward pass, whatever the batch or prefill window) goes:

1. the experts the layer's rows chose (their union) are pinned into slots: a hit is a slot that holds it
   already (or is being filled by a prefetch); a miss takes a free slot or evicts an unpinned one (policy) and
   queues its read, all misses at once, ahead of any prefetch;
2. prefetch: the next MoE layer's router is applied to this layer's input and the experts it picks are queued
   for reading into slots that are neither pinned nor holding that layer's experts;
3. the experts already in memory are computed while the misses read; then the rest, once read;
4. pins are released. A layer needing more experts than the pool has slots (a long prefill window) runs in
   waves of at most that many.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from deltafin.engine.experts.checkpoint import ExpertIndex
from deltafin.engine.experts.policy import EvictionPolicy
from deltafin.engine.experts.reader import MISS, PREFETCH, ReadQueue
from deltafin.engine.experts.routing import FEW_PAIRS, combine, run_listed_pairs, run_pairs

log = structlog.get_logger("deltafin.engine")

Key = tuple[int, int]  # (layer, expert)


class PoolExhausted(RuntimeError):
    """No slot can be freed: every slot is pinned by the running layer (a sizing bug, never a client's)."""


@dataclass(frozen=True)
class PoolCounters:
    """Running totals; the difference of two snapshots is what happened between them."""

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0

    def __sub__(self, other: PoolCounters) -> PoolCounters:
        return PoolCounters(self.hits - other.hits, self.misses - other.misses, self.bytes_read - other.bytes_read)

    def __add__(self, other: PoolCounters) -> PoolCounters:
        return PoolCounters(self.hits + other.hits, self.misses + other.misses, self.bytes_read + other.bytes_read)


@dataclass(frozen=True)
class PoolStats:
    """A snapshot for /metrics (read at scrape time)."""

    slots: int
    occupied: int
    slot_bytes: int
    hits: int
    misses: int
    bytes_read: int
    prefetch_reads: int
    prefetch_hits: int
    wait_seconds: float


class ExpertPool:
    def __init__(
        self,
        index: ExpertIndex,
        slots: Any,
        source: Any,
        policy: EvictionPolicy,
        *,
        slot_bytes: int,
        routers: Sequence[Any | None],
        prefetch: bool,
        readers: int,
    ) -> None:
        self.index = index
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.policy = policy
        self.prefetch = prefetch
        #: routers[layer]: the router of MoE layer `layer` (None: that layer is never prefetched)
        self._routers = list(routers)
        #: where a miss reads from (`store.CheckpointSource` or `store.RecordCopy`)
        self.source = source
        self._queue = ReadQueue(readers)
        count = slots.count
        self._where: dict[Key, int] = {}
        self._holds: list[Key | None] = [None] * count
        self._pins = [0] * count
        self._loading: dict[int, concurrent.futures.Future] = {}
        self._free = list(range(count - 1, -1, -1))
        self._prefetched: set[Key] = set()  # read by a prefetch and not used since
        self._tick = 0
        self.hits = self.misses = self.bytes_read = 0
        self.prefetch_reads = self.prefetch_hits = 0
        self.wait_seconds = 0.0

    # What the engine and /metrics read.

    def counters(self) -> PoolCounters:
        return PoolCounters(self.hits, self.misses, self.bytes_read)

    def stats(self) -> PoolStats:
        return PoolStats(
            slots=self.slots.count,
            occupied=self.slots.count - len(self._free),
            slot_bytes=self.slot_bytes,
            hits=self.hits,
            misses=self.misses,
            bytes_read=self.bytes_read,
            prefetch_reads=self.prefetch_reads,
            prefetch_hits=self.prefetch_hits,
            wait_seconds=self.wait_seconds,
        )

    def compute_threads(self, threads: int) -> int:
        """The torch threads to run the model with beside this pool's readers, out of `threads`: one fewer
        where the reads copy through the page cache (a read from the page cache is a CPU copy, and an OpenMP
        team spinning on every core starves it: on 2 cores, 1 thread ran the float pool 1/8 at 10.4 tokens/s,
        2 threads at 8.8); all of them where reads go disk-to-slot (the int8 copy read with O_DIRECT)."""
        return threads if getattr(self.source, "direct", False) else max(1, threads - 1)

    def close(self) -> None:
        self._queue.close()
        self.source.close()

    # One experts call.

    def forward(
        self, layer: int, module: Any, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """hidden: [T, H]; top_k_index, top_k_weights: [T, k] -> the routed experts' output [T, H]."""
        self._tick += 1
        tokens, k = top_k_index.shape
        ids = top_k_index.reshape(-1)  # [T * k], one entry per (token, choice) pair
        weights = top_k_weights.reshape(-1)
        # the one host sync of the call: a few pairs' experts as a list (grouped in Python), else their union
        pair_experts = ids.tolist() if ids.numel() <= FEW_PAIRS else None
        needed = sorted(set(pair_experts)) if pair_experts is not None else torch.unique(ids).tolist()
        size = self.slots.count
        waves = [needed[at : at + size] for at in range(0, len(needed), size)]
        out: torch.Tensor | None = None
        for wave in waves:
            slot_of, pending = self._acquire(layer, wave)
            try:
                if self.prefetch and len(waves) == 1:
                    # Routers read the MoE block's input; a latent MoE's experts get a narrower one, so such a
                    # block hands its routers' input beside (Kimi K3: `router_input`).
                    router_input = getattr(module, "router_input", None)
                    self._prefetch_next(layer, hidden if router_input is None else router_input)
                ready = {e: s for e, s in slot_of.items() if s not in pending}
                if ready:  # computed while the misses read
                    out = self._run(module, hidden, ids, pair_experts, weights, k, ready, out)
                if pending:
                    self._wait(pending)
                    rest = {e: s for e, s in slot_of.items() if s in pending}
                    out = self._run(module, hidden, ids, pair_experts, weights, k, rest, out)
            finally:
                for slot in slot_of.values():
                    self._pins[slot] -= 1
        assert out is not None
        return combine(out, tokens, k, hidden.dtype)

    def _run(
        self,
        module: Any,
        hidden: torch.Tensor,
        ids: torch.Tensor,
        pair_experts: list[int] | None,
        weights: torch.Tensor,
        k: int,
        slot_of: dict[int, int],
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        """Compute the (token, choice) pairs routed to the experts in `slot_of` into `out` [T * k, H]
        (`pair_experts`: `ids` as a list, for a call of a few pairs)."""
        if pair_experts is not None:
            return run_listed_pairs(self.slots, module, hidden, pair_experts, weights, k, slot_of, out)
        lut = torch.full((self.index.experts,), -1, dtype=torch.long, device=ids.device)
        lut[torch.tensor(list(slot_of), device=ids.device)] = torch.tensor(list(slot_of.values()), device=ids.device)
        return run_pairs(self.slots, module, hidden, ids, weights, k, lut, out)

    # Slots.

    def _acquire(self, layer: int, experts: list[int]) -> tuple[dict[int, int], dict[int, concurrent.futures.Future]]:
        """Pin a slot holding each expert (reading the misses); returns expert -> slot and the slots still
        being read (slot -> future)."""
        slot_of: dict[int, int] = {}
        pending: dict[int, concurrent.futures.Future] = {}
        for expert in experts:
            key = (layer, expert)
            slot = self._where.get(key)
            if slot is not None and self._failed(slot):
                slot = None  # its read failed: read it again
            if slot is None:
                slot = self._take_slot(protect=None, wait=True)
                assert slot is not None
                self._assign(slot, key)
                self._start_read(slot, key, MISS)
                self.misses += 1
            else:
                self.hits += 1
                if key in self._prefetched:
                    self._prefetched.discard(key)
                    self.prefetch_hits += 1
            self._pins[slot] += 1
            self.policy.touch(slot, self._tick)
            slot_of[expert] = slot
            future = self._loading.get(slot)
            if future is not None:
                if future.done():
                    del self._loading[slot]
                else:
                    pending[slot] = future
        return slot_of, pending

    def _wait(self, pending: dict[int, concurrent.futures.Future]) -> None:
        started = time.perf_counter()
        concurrent.futures.wait(pending.values())
        self.wait_seconds += time.perf_counter() - started
        failed = None
        for slot, future in pending.items():
            self._loading.pop(slot, None)
            if future.exception() is not None:
                failed = failed or future.exception()
                self._unassign(slot)
                self._free.append(slot)
        if failed is not None:
            raise failed

    def _failed(self, slot: int) -> bool:
        """A finished read that failed leaves its slot empty (the expert is absent again)."""
        future = self._loading.get(slot)
        if future is None or not future.done() or future.exception() is None:
            return False
        del self._loading[slot]
        log.warning("expert_read_failed", error=str(future.exception()))
        self._unassign(slot)
        self._free.append(slot)
        return True

    def _evictable(self, slot: int, protect: int | None) -> bool:
        if self._pins[slot]:
            return False
        future = self._loading.get(slot)
        if future is not None:
            if not future.done():
                return False  # a read is writing into it
            del self._loading[slot]
        holds = self._holds[slot]
        return protect is None or holds is None or holds[0] != protect

    def _take_slot(self, *, protect: int | None, wait: bool) -> int | None:
        """A free slot, or the policy's victim among unpinned slots no read is filling (and, for a prefetch,
        not holding an expert of the layer it prefetches for). With `wait`, wait for an unpinned read
        in flight rather than give up."""
        if self._free:
            return self._free.pop()
        while True:
            slot = self.policy.victim(lambda s: self._evictable(s, protect))
            if slot is not None:
                self._unassign(slot)
                return slot
            if not wait:
                return None
            busy = [f for s, f in self._loading.items() if not self._pins[s] and not f.done()]
            if not busy:
                raise PoolExhausted(f"all {self.slots.count} expert slots are pinned by the running layer")
            concurrent.futures.wait(busy, return_when=concurrent.futures.FIRST_COMPLETED)

    def _assign(self, slot: int, key: Key) -> None:
        self._where[key] = slot
        self._holds[slot] = key
        self.policy.forget(slot)  # the new expert's history starts now

    def _unassign(self, slot: int) -> None:
        key = self._holds[slot]
        if key is not None:
            del self._where[key]
            self._prefetched.discard(key)
        self._holds[slot] = None
        self.policy.forget(slot)

    def _start_read(self, slot: int, key: Key, priority: int) -> None:
        layer, expert = key
        self._loading[slot] = self._queue.submit(priority, lambda: self.source.fill(self.slots, slot, layer, expert))
        self.bytes_read += self.source.nbytes(layer, expert)

    # Prefetch.

    def _prefetch_next(self, layer: int, hidden: torch.Tensor) -> None:
        """Queue reads of the experts the next MoE layer's router picks for this layer's input."""
        target = layer + 1
        router = self._routers[target] if target < len(self._routers) else None
        if router is None:
            return
        chosen = router(hidden)[2]  # (logits, weights, indices) -> [T, k]
        if chosen.numel() <= FEW_PAIRS:  # a decode step's few choices: counted in Python
            picks = chosen.reshape(-1).tolist()
            wanted = sorted(set(picks), key=lambda e: (-picks.count(e), e))
        else:
            experts, counts = torch.unique(chosen, return_counts=True)
            wanted = experts[counts.argsort(descending=True, stable=True)].tolist()
        for expert in wanted:  # most wanted first (ties: the lower number)
            key = (target, expert)
            if key in self._where:
                continue
            slot = self._take_slot(protect=target, wait=False)
            if slot is None:
                return  # every other slot is pinned or being read: the rest will be misses
            self._assign(slot, key)
            self.policy.touch(slot, self._tick)
            self._prefetched.add(key)
            self._start_read(slot, key, PREFETCH)
            self.prefetch_reads += 1
