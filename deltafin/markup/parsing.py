"""Output parser building blocks: what a parser emits, and the marker scanning they all share.

A parser is fed a choice's text as the engine produces it and returns what may be shown now: reasoning,
answer content, tool-call deltas. Text that may be the start of a marker stays inside the parser until it
is known; `finish()` flushes what is left: at a normal end it is text (a trailing "<" is the model's), after
max_tokens a cut-off marker is dropped.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class ToolCallDelta:
    """One piece of a tool call: the first has id and name (arguments ""), later ones argument fragments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def extend(self, other: ParsedDelta) -> ParsedDelta:
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls.extend(other.tool_calls)
        return self


class OutputParser(Protocol):
    def feed(self, text: str) -> ParsedDelta: ...

    def finish(self, finish_reason: str) -> ParsedDelta: ...


def random_call_id(index: int, name: str) -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def kimi_call_ids(offset: int) -> IdFactory:
    """Kimi's `functions.NAME:IDX`, IDX counted over the whole conversation (calls in history + position)."""
    return lambda index, name: f"functions.{name}:{offset + index}"


#: (index of the call in this answer, function name) -> tool call id
IdFactory = Callable[[int, str], str]


def split_at_marker(buffer: str, markers: Sequence[str]) -> tuple[str, str | None, str]:
    """Find the earliest complete marker: (text before, marker, text after). Without one:
    (text that is safe to release, None, the suffix held back because it may begin a marker)."""
    best: tuple[int, str] | None = None
    for marker in markers:
        index = buffer.find(marker)
        if index >= 0 and (best is None or index < best[0]):
            best = (index, marker)
    if best is not None:
        index, marker = best
        return buffer[:index], marker, buffer[index + len(marker) :]
    keep = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(buffer)), keep, -1):
            if marker.startswith(buffer[-size:]):
                keep = size
                break
    return buffer[: len(buffer) - keep], None, buffer[len(buffer) - keep :]


def is_partial_marker(text: str, markers: Sequence[str]) -> bool:
    stripped = text.lstrip()
    return bool(stripped) and any(m.startswith(stripped) for m in markers)


def released_at_finish(held: str, markers: Sequence[str], finish_reason: str) -> str:
    """What held-back text becomes at the end. After a natural end a held "<" was never going to be a
    marker: it is the model's text. After max_tokens it may be a marker cut in half: dropped, never leaked."""
    if finish_reason == "length" and is_partial_marker(held, markers):
        return ""
    return held


class PlainOutputParser:
    """Every character is answer content (models without reasoning or tool-call markup)."""

    def feed(self, text: str) -> ParsedDelta:
        return ParsedDelta(content=text)

    def finish(self, finish_reason: str) -> ParsedDelta:
        return ParsedDelta()
