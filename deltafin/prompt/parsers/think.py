"""Reasoning between a start and an end marker (`<think>` ... `</think>`), the rest is answer text.

Used by Kimi K2 and GLM. The prompt decides where output starts: a prompt ending in the start marker
(a prefilled `<think>`: K2.5+, GLM-4.7 with thinking on) starts inside reasoning; otherwise the model may
open reasoning itself at the very start (GLM-4.5). `terminators` (e.g. `<tool_call>`) also end reasoning
but stay in the text for the tool parser: a tool call opened inside reasoning ends it.
"""

from __future__ import annotations

from typing import Sequence

from deltafin.prompt.parsers.base import ParsedDelta, is_partial_marker, split_at_marker

_START, _REASONING, _CONTENT = "start", "reasoning", "content"


class ThinkReasoningParser:
    def __init__(self, *, start: str, end: str, terminators: Sequence[str] = (), starts_in_reasoning: bool) -> None:
        self._start_marker = start
        self._end = end
        self._terminators = tuple(terminators)
        self._prefilled = starts_in_reasoning
        self._state = _REASONING if starts_in_reasoning else _START
        self._held = ""
        self._reasoning_seen = ""
        self._closed = False

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        buffer = self._held + text
        self._held = ""
        while buffer:
            if self._state == _START:
                stripped = buffer.lstrip()
                if not stripped or (self._start_marker.startswith(stripped) and stripped != self._start_marker):
                    self._held = buffer  # whitespace or a partial <think>: not known yet
                    return out
                if stripped.startswith(self._start_marker):
                    buffer = stripped[len(self._start_marker) :]
                    self._state = _REASONING
                else:
                    self._state = _CONTENT
            elif self._state == _REASONING:
                before, marker, after = split_at_marker(buffer, (self._end, *self._terminators))
                out.reasoning += before
                self._reasoning_seen += before
                if marker is None:
                    self._held = after
                    return out
                self._state = _CONTENT
                if marker == self._end:
                    self._closed = True
                    buffer = after
                else:
                    buffer = marker + after
            else:
                out.content += buffer
                return out
        return out

    def finish(self, finish_reason: str) -> ParsedDelta:
        held, self._held = self._held, ""
        out = ParsedDelta()
        if self._state == _REASONING:
            if not is_partial_marker(held, (self._end, *self._terminators)):
                out.reasoning += held
                self._reasoning_seen += held
            # A prefilled <think> that never closed before a natural stop: the model answered without
            # thinking. Do not swallow the answer into reasoning (the known upstream bug).
            if self._prefilled and not self._closed and finish_reason == "stop" and self._reasoning_seen:
                return ParsedDelta(content=self._reasoning_seen, reasoning_retracted=True)
        elif self._state == _START and not is_partial_marker(held, (self._start_marker,)):
            out.content += held
        return out
