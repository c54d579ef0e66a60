"""Deterministic response memo: identical greedy/seeded jobs replay their recorded output from an LRU."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence

from deltafin.engine.events import Event


class ResponseMemo:
    def __init__(self, entries: int) -> None:
        self._entries = entries
        self._items: OrderedDict[Hashable, tuple[Event, ...]] = OrderedDict()
        # Read by the event loop, written by the generation thread.
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self._entries > 0

    def get(self, key: Hashable) -> tuple[Event, ...] | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: Hashable, events: Sequence[Event]) -> None:
        if self._entries <= 0:
            return
        with self._lock:
            self._items[key] = tuple(events)
            self._items.move_to_end(key)
            while len(self._items) > self._entries:
                self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)
