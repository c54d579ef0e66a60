"""N-gram drafts (prompt lookup): the tokens that followed the latest earlier occurrence of the row's last n tokens.

An agent rewriting code it was just shown, or quoting a document, writes long runs of tokens that are already
in its context; once its last few tokens match a place there, the tokens after that place are a good guess at
what comes next. Runs of `ngram_max` down to `ngram_min` tokens are tried, longest first (a longer match is
less often a coincidence); the latest earlier occurrence wins (the nearest context is the likeliest to go on).

Each row keeps an index of its own context (every n-gram, n in [min, max], to the position after its latest
occurrence), grown by the tokens added since the last lookup: a lookup costs a few dictionary reads however long
the context is.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any


class NgramIndex:
    """The n-grams of one growing token sequence."""

    def __init__(self, low: int, high: int) -> None:
        self.low, self.high = low, high
        #: per n: n-gram -> the position after its latest occurrence that ends before the sequence's end
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(low, high + 1)}
        self.indexed = 0  # n-grams ending at positions up to this one are in the tables

    def propose(self, context: Sequence[int], limit: int) -> list[int]:
        """Up to `limit` tokens guessed to follow `context` (the same sequence as before, grown), or none."""
        end = len(context)
        # Index the n-grams that end before the last position (the one ending there is what is looked up).
        for stop in range(self.indexed + 1, end):
            for n, table in self.tables.items():
                if stop >= n:
                    table[tuple(context[stop - n : stop])] = stop
        self.indexed = max(self.indexed, end - 1)
        if limit <= 0:
            return []
        for n in range(min(self.high, end), self.low - 1, -1):
            after = self.tables[n].get(tuple(context[end - n :]))
            if after is not None:
                return list(context[after : after + limit])
        return []


class NgramDrafter:
    """Drafts for every row from its own context (its prompt, every token it fed, its pending token)."""

    cost_per_token = 0.0  # a lookup, no forward pass

    def __init__(self, low: int, high: int) -> None:
        self.low, self.high = low, high
        self._indexes: weakref.WeakKeyDictionary[Any, NgramIndex] = weakref.WeakKeyDictionary()

    def propose(self, rows: Sequence[Any], limits: Sequence[int]) -> list[list[int]]:
        drafts: list[list[int]] = []
        for row, limit in zip(rows, limits):
            index = self._indexes.get(row)
            if index is None:
                index = self._indexes[row] = NgramIndex(self.low, self.high)
            context = row.ids + [row.pending]
            drafts.append(index.propose(context, limit))
        return drafts
