"""Output parser building blocks: what a parser emits, and the marker scanning they all share.

A parser is fed a choice's text as the engine produces it and returns what may be shown now: reasoning,
answer content, tool-call deltas. Text that may be the start of a marker stays inside the parser until it
is known; `finish()` flushes what is left, dropping a marker cut off by max_tokens.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence


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
    # Set by finish() when text streamed as reasoning turned out to be the answer (a prefilled <think> that
    # never closed before EOS): `content` then repeats it, and whole responses drop the reasoning.
    reasoning_retracted: bool = False

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls or self.reasoning_retracted)

    def extend(self, other: "ParsedDelta") -> "ParsedDelta":
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls.extend(other.tool_calls)
        self.reasoning_retracted = self.reasoning_retracted or other.reasoning_retracted
        return self


class OutputParser(Protocol):
    def feed(self, text: str) -> ParsedDelta: ...

    def finish(self, finish_reason: str) -> ParsedDelta: ...


def random_call_id(index: int, name: str) -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def kimi_call_ids(offset: int) -> "IdFactory":
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


class PlainOutputParser:
    """Every character is answer content (models without reasoning or tool-call markup)."""

    def feed(self, text: str) -> ParsedDelta:
        return ParsedDelta(content=text)

    def finish(self, finish_reason: str) -> ParsedDelta:
        return ParsedDelta()


def schema_types(tools: Sequence[Any] | None) -> dict[str, dict[str, str]]:
    """{tool name: {argument: JSON-schema type}} from OpenAI tool definitions (dicts or protocol structs)."""
    out: dict[str, dict[str, str]] = {}
    for tool in tools or ():
        function = tool["function"] if isinstance(tool, dict) else tool.function
        name = function["name"] if isinstance(function, dict) else function.name
        params = (function.get("parameters") if isinstance(function, dict) else function.parameters) or {}
        props = params.get("properties") or {}
        types: dict[str, str] = {}
        for key, prop in props.items():
            kind = prop.get("type") if isinstance(prop, dict) else None
            if isinstance(kind, list):  # ["string", "null"]
                kind = next((k for k in kind if k != "null"), None)
            if isinstance(kind, str):
                types[key] = kind
        out[name] = types
    return out
