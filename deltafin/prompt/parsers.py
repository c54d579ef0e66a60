"""Output parsers: turn a choice's streamed text into content, reasoning and tool-call deltas.

A parser is fed text as the engine produces it and returns what may be shown now; text that may be the
start of a marker stays inside the parser until it is known. `finish()` flushes what is left.
Model families register their parsers by name (model.reasoning_parser / model.tool_parser).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol


@dataclass
class ToolCallDelta:
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


class OutputParser(Protocol):
    def feed(self, text: str) -> ParsedDelta: ...

    def finish(self) -> ParsedDelta: ...


class PlainOutputParser:
    """Every character is answer content (models without reasoning or tool-call markup)."""

    def feed(self, text: str) -> ParsedDelta:
        return ParsedDelta(content=text)

    def finish(self) -> ParsedDelta:
        return ParsedDelta()


ParserFactory = Callable[..., OutputParser]
OUTPUT_PARSERS: dict[str, ParserFactory] = {"plain": lambda **_: PlainOutputParser()}


def build_output_parser(name: str | None, **options: Any) -> OutputParser:
    """A fresh parser for one choice; `name` None means plain text."""
    key = name or "plain"
    try:
        return OUTPUT_PARSERS[key](**options)
    except KeyError:
        raise ValueError(f"unknown output parser {key!r} (known: {', '.join(OUTPUT_PARSERS)})") from None
