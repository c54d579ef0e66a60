"""Reuse of earlier generations' KV caches when a new prompt extends one of them (multi-turn chat, agents)."""

from __future__ import annotations

from typing import Any, Callable, Sequence


class PrefixCache:
    """Holds up to `entries` KV caches (one row each) and the token ids each covers, most recent last.

    Only the engine's owner thread touches it. A cache is taken out while a request uses it, so a request
    that dies mid-way leaves nothing half-written behind; the engine gives caches back when rows leave."""

    def __init__(self, new_cache: Callable[[], Any], min_reuse: int = 16, entries: int = 4) -> None:
        self._new_cache = new_cache
        self._min_reuse = min_reuse
        self._entries = max(1, entries)
        self._items: list[tuple[Any, list[int]]] = []

    def __len__(self) -> int:
        return len(self._items)

    def take(self, prompt_ids: Sequence[int]) -> tuple[Any, int]:
        """A cache holding the longest reusable prefix of `prompt_ids`, and that prefix's length."""
        best, shared = -1, 0
        for index, (_, ids) in enumerate(self._items):
            common = _common_prefix(ids, prompt_ids)
            if common >= shared:  # ties go to the most recent entry
                best, shared = index, common
        # At least one prompt token must be run to get the next logits.
        shared = min(shared, max(len(prompt_ids) - 1, 0))
        if best < 0 or shared < self._min_reuse or not getattr(self._items[best][0], "is_croppable", True):
            return self._new_cache(), 0
        cache, ids = self._items.pop(best)
        surplus = len(ids) - shared
        if surplus:
            cache.crop(-surplus)  # transformers 5: a negative count removes that many trailing tokens
        return cache, shared

    def give_back(self, cache: Any, ids: list[int]) -> None:
        """Offers `cache` (holding exactly `ids`) to later requests; the oldest entry goes when full."""
        if not ids:
            return
        # An entry that is a prefix of the new one is never the better match: drop it.
        self._items = [(c, old) for c, old in self._items if _common_prefix(old, ids) < len(old)]
        self._items.append((cache, list(ids)))
        del self._items[: -self._entries]

    def clear(self) -> None:
        self._items = []


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
