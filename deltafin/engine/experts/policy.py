"""Which expert leaves a full pool (`placement.experts.policy`).

- `lru`: the least recently used.
- `lfru`: frequency-weighted recency (LRFU, Lee et al. 2001): every use adds 1 to a slot's score and the score
  halves every `half_life` ticks, so an expert used often a while ago can outlast one used once just now.
  Routers are skewed towards some experts in trained models; that skew is what `lfru` keeps.

Both are "lowest key leaves" with a key that never changes between uses: LRU's is the time of the last use;
LRFU's score at time t is crf * 2^(-(t - last) / half_life) = 2^(log2(crf) + last / half_life) * 2^(-t / half_life),
so ordering by log2(crf) + last / half_life orders by current score at every t. One heap with stale entries
skipped serves both: a victim costs O(log slots), which matters at thousands of slots and misses per step.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable


class EvictionPolicy:
    """A heap of (key, slot); `touch` records a use, `victim` pops the lowest key whose slot is eligible."""

    name = "lru"

    def __init__(self, slots: int) -> None:
        self._key: list[float | None] = [None] * slots
        self._heap: list[tuple[float, int]] = []
        self._slots = slots

    def _next_key(self, slot: int, now: float) -> float:
        return now

    def touch(self, slot: int, now: float) -> None:
        key = self._next_key(slot, now)
        self._key[slot] = key
        heapq.heappush(self._heap, (key, slot))
        if len(self._heap) > 4 * self._slots + 64:  # drop stale entries now and then
            self._heap = [(k, s) for s, k in enumerate(self._key) if k is not None]
            heapq.heapify(self._heap)

    def forget(self, slot: int) -> None:
        self._key[slot] = None

    def victim(self, eligible: Callable[[int], bool]) -> int | None:
        """The slot to evict among those `eligible` says may go (None if none may); it stays in the policy
        until touched again or forgotten."""
        passed: list[tuple[float, int]] = []
        chosen = None
        while self._heap:
            key, slot = heapq.heappop(self._heap)
            if self._key[slot] != key:
                continue  # stale: the slot was used again since, or forgotten
            passed.append((key, slot))
            if eligible(slot):
                chosen = slot
                break
        for entry in passed:
            heapq.heappush(self._heap, entry)
        return chosen


class LfruPolicy(EvictionPolicy):
    name = "lfru"

    def __init__(self, slots: int, half_life: float) -> None:
        super().__init__(slots)
        self.half_life = half_life
        self._crf = [0.0] * slots
        self._last = [0.0] * slots

    def _next_key(self, slot: int, now: float) -> float:
        decayed = self._crf[slot] * 2.0 ** (-(now - self._last[slot]) / self.half_life)
        self._crf[slot] = crf = 1.0 + decayed
        self._last[slot] = now
        return math.log2(crf) + now / self.half_life

    def forget(self, slot: int) -> None:
        super().forget(slot)
        self._crf[slot] = 0.0  # the next expert in this slot starts its own count


def make_policy(name: str, slots: int, *, half_life: float) -> EvictionPolicy:
    """`half_life` in ticks (the pool ticks once per experts call: layers x steps)."""
    if name == "lru":
        return EvictionPolicy(slots)
    if name == "lfru":
        return LfruPolicy(slots, half_life)
    raise ValueError(f"placement.experts.policy: {name!r} is not one of lru, lfru")
