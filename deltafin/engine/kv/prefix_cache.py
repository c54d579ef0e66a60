"""Reuse of earlier generations' caches when a new prompt extends one of them (multi-turn chat, agents).

An attention-only cache is a list of positions: any shared prefix of it is reusable, cut back with `crop`.
A cache holding recurrent state (linear-attention layers, `deltafin.engine.kv.cache_layers`) is a summary of
exactly the tokens it saw: it is reused only when all of them start the new prompt, never cut back."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from deltafin.engine.kv.cache_layers import exact_length_only

#: attribute set (True) on every cache `take` hands out: nothing else references its storage past its (cropped)
#: length, so a forward may append there in place instead of copying the whole cache to new buffers (the native
#: step does: deltafin.engine.llama.native). True of every entry the engine gives back: a prompt's cache after the
#: batch copied it, or a row's view into batch buffers the batch drops when the row leaves.
SOLE_OWNER = "deltafin_sole_owner"


class PrefixCache:
    """Holds up to `entries` caches (one row each) and the token ids each covers, most recent last.

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
        # At least one prompt token must be run to get the next logits.
        limit = max(len(prompt_ids) - 1, 0)
        best, shared = -1, 0
        for index, (cache, ids) in enumerate(self._items):
            usable = _reusable(cache, ids, prompt_ids, limit)
            if usable >= shared:  # ties go to the most recent entry
                best, shared = index, usable
        if best < 0 or shared < self._min_reuse:
            return self._new_cache(), 0
        cache, ids = self._items.pop(best)
        surplus = len(ids) - shared
        if surplus:
            cache.crop(-surplus)  # transformers 5: a negative count removes that many trailing tokens
        setattr(cache, SOLE_OWNER, True)
        return cache, shared

    def give_back(self, cache: Any, ids: list[int]) -> None:
        """Offers `cache` (holding exactly `ids`) to later requests; the oldest entry goes when full."""
        if not ids:
            return
        # An attention-only entry that is a prefix of the new one is never the better match: drop it. One
        # with recurrent state still serves prompts that leave the new entry's path after it (an assistant
        # turn rendered back otherwise than it was generated): only an identical one goes.
        self._items = [
            (c, old)
            for c, old in self._items
            if _common_prefix(old, ids) < len(old) or (exact_length_only(c) and old != ids)
        ]
        self._items.append((cache, list(ids)))
        del self._items[: -self._entries]

    def clear(self) -> None:
        self._items = []


def _reusable(cache: Any, ids: Sequence[int], prompt_ids: Sequence[int], limit: int) -> int:
    """How many leading tokens of the prompt `cache` (holding `ids`) can stand for."""
    common = min(_common_prefix(ids, prompt_ids), limit)
    if exact_length_only(cache):
        return len(ids) if common == len(ids) else 0
    return common


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
