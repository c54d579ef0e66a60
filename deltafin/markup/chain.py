"""How a family's parsers are put together for one choice."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from deltafin.markup.parsing import OutputParser, ParsedDelta


class ChainedParser:
    """Reasoning parser first; the answer text it lets through goes to the tool-call parser."""

    def __init__(self, reasoning: Any | None, tools: Any | None) -> None:
        self._reasoning = reasoning
        self._tools = tools

    def _tools_on(self, delta: ParsedDelta, feed: Callable[[str], ParsedDelta] | None) -> ParsedDelta:
        if feed is None or not delta.content:
            return delta
        parsed = feed(delta.content)
        delta.content = parsed.content
        delta.tool_calls.extend(parsed.tool_calls)
        return delta

    def feed(self, text: str) -> ParsedDelta:
        delta = self._reasoning.feed(text) if self._reasoning else ParsedDelta(content=text)
        return self._tools_on(delta, self._tools.feed if self._tools else None)

    def finish(self, finish_reason: str) -> ParsedDelta:
        delta = self._reasoning.finish(finish_reason) if self._reasoning else ParsedDelta()
        delta = self._tools_on(delta, self._tools.feed if self._tools else None)
        if self._tools is not None:
            delta.extend(self._tools.finish(finish_reason))
        return delta


class BlankContentBesideCalls:
    """Whitespace-only content beside tool calls is no content (`null`, as vLLM returns it): layout such as
    "\\n    " before a call is held until the answer shows real text (then released with it) or ends (then
    dropped if calls were made, kept if not). Once real text was shown, all content passes unchanged."""

    def __init__(self, inner: OutputParser) -> None:
        self._inner = inner
        self._pending: list[str] = []  # whitespace held so far, in pieces (joined once: a long run stays linear)
        self._shown = False
        self._calls = False

    def _filter(self, delta: ParsedDelta, *, final: bool) -> ParsedDelta:
        self._calls = self._calls or bool(delta.tool_calls)
        if self._shown:
            return delta
        if delta.content.strip():
            self._shown, delta.content = True, "".join(self._pending) + delta.content
            self._pending = []
        elif final:
            held = "".join(self._pending) + delta.content
            self._pending, delta.content = [], "" if self._calls else held
        else:
            self._pending.append(delta.content)
            delta.content = ""
        return delta

    def feed(self, text: str) -> ParsedDelta:
        return self._filter(self._inner.feed(text), final=False)

    def finish(self, finish_reason: str) -> ParsedDelta:
        return self._filter(self._inner.finish(finish_reason), final=True)
