"""Checkpoints of a hybrid model's recurrent and convolution states, taken during a prompt's prefill.

A state layer's state stands for exactly the tokens it saw and cannot be cut back (`cache_layers`), so a cache of
such a model can only be reused by a prompt that starts with all of its tokens. A `CheckpointBook` rides on a
prompt's cache (an attribute, so every path that carries the cache carries it) and holds copies of the states at
every `every`-th prompt position: a later prompt that shares the first M tokens starts from the last checkpoint at
or before M, with the attention layers' positions cut to the same length (vLLM's hybrid prefix caching keeps
states at block boundaries the same way).

The prefill (`deltafin.engine.local.generator.PromptPrefill`) asks the book where its next window must end
(`next_stop`) and hands it the cache after every window (`reached`); the book copies the states when the cache
stands on a checkpoint position. Captures are never written again (a cache that starts from one gets a copy), so
one capture is shared by every entry whose tokens pass through it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deltafin.engine.kv import cache_layers

#: the attribute a cache's book rides on
BOOK = "deltafin_checkpoints"


@dataclass(eq=False)
class Capture:
    """The states of every layer at one position (`cache_layers.capture_states`), and their bytes."""

    states: list[Any]
    nbytes: int

    @classmethod
    def of(cls, cache: Any, *, copy: bool = True) -> Capture:
        """The states `cache` holds now; `copy=False` takes the tensors themselves, for a cache that is never
        run again (an entry folded into a longer one)."""
        return cls.of_states(cache_layers.capture_states(cache, copy=copy))

    @classmethod
    def of_states(cls, states: list[Any]) -> Capture:
        tensors = [t for _, _, _, t in cache_layers.state_tensors(states)]
        return cls(states, cache_layers.logical_bytes(tensors))


@dataclass(eq=False)
class CheckpointBook:
    """Captures by position (tokens before it) of one token sequence; `every` None takes none during prefill
    (the book then only carries captures an entry already had)."""

    every: int | None
    at: dict[int, Capture] = field(default_factory=dict)

    def next_stop(self, position: int) -> int | None:
        """The next checkpoint position after `position`, where a prefill window must end."""
        if not self.every:
            return None
        return (position // self.every + 1) * self.every

    def reached(self, cache: Any, position: int) -> None:
        """The cache now holds exactly `position` tokens: capture its states if that is a checkpoint position."""
        if self.every and position % self.every == 0 and position not in self.at:
            self.at[position] = Capture.of(cache)

    def best(self, limit: int) -> int:
        """The last checkpoint at or before `limit` (0: none)."""
        return max((p for p in self.at if p <= limit), default=0)

    def upto(self, limit: int) -> dict[int, Capture]:
        return {p: c for p, c in self.at.items() if p <= limit}


def book_of(cache: Any) -> CheckpointBook | None:
    return getattr(cache, BOOK, None)


def attach(cache: Any, book: CheckpointBook) -> None:
    setattr(cache, BOOK, book)
