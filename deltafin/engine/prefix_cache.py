"""Reuse of the previous generation's KV cache when the next prompt extends it (multi-turn chat, agents)."""

from __future__ import annotations

from typing import Any, Callable, Sequence


class PrefixCache:
    """Holds at most one KV cache and the token ids it covers; only the generation thread touches it."""

    def __init__(self, new_cache: Callable[[], Any], min_reuse: int = 16) -> None:
        self._new_cache = new_cache
        self._min_reuse = min_reuse
        self._cache: Any = None
        self._ids: list[int] = []

    def take(self, prompt_ids: Sequence[int]) -> tuple[Any, int]:
        """A cache holding the longest reusable prefix of `prompt_ids`, and that prefix's length."""
        cache, ids = self._cache, self._ids
        self._cache, self._ids = None, []  # taken: a generation that dies mid-way leaves nothing behind
        shared = _common_prefix(ids, prompt_ids)
        # At least one prompt token must be run to get the next logits.
        shared = min(shared, max(len(prompt_ids) - 1, 0))
        if cache is None or shared < self._min_reuse or not getattr(cache, "is_croppable", True):
            return self._new_cache(), 0
        surplus = len(ids) - shared
        if surplus:
            cache.crop(-surplus)  # transformers 5: a negative count removes that many trailing tokens
        return cache, shared

    def give_back(self, cache: Any, ids: list[int]) -> None:
        self._cache, self._ids = cache, ids

    def clear(self) -> None:
        self._cache, self._ids = None, []


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
