"""Reasoning between a start and an end marker (`<think>` ... `</think>`), the rest is answer text.

Used by Kimi K2, GLM and Qwen3. The prompt decides where output starts: a prompt ending in the start marker
(a prefilled `<think>`: K2.5+, GLM-4.7 with thinking on) starts inside reasoning, and a model that writes
the opener again anyway has it dropped; otherwise the model may open reasoning itself at the very start
(GLM-4.5, Qwen3). Reasoning still open when generation ends stays reasoning (as vLLM and SGLang do).
`terminators` (e.g. `<tool_call>`) also end reasoning but stay in the text for the tool parser: a tool call
opened inside reasoning ends it.
"""

from __future__ import annotations

from typing import Sequence

from deltafin.prompt.parsers.base import ParsedDelta, released_at_finish, split_at_marker

# _START: the model may open reasoning; _OPENER: reasoning is open and a repeated opener is dropped.
_START, _OPENER, _REASONING, _CONTENT = "start", "opener", "reasoning", "content"


class ThinkReasoningParser:
    def __init__(self, *, start: str, end: str, terminators: Sequence[str] = (), starts_in_reasoning: bool) -> None:
        self._start_marker = start
        self._end = end
        self._terminators = tuple(terminators)
        self._state = _OPENER if starts_in_reasoning else _START
        self._held = ""

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        buffer = self._held + text
        self._held = ""
        while buffer:
            if self._state in (_START, _OPENER):
                stripped = buffer.lstrip()
                if not stripped or (self._start_marker.startswith(stripped) and stripped != self._start_marker):
                    self._held = buffer  # whitespace or a partial <think>: not known yet
                    return out
                opened = stripped.startswith(self._start_marker)
                if opened:
                    buffer = stripped[len(self._start_marker) :]
                self._state = _REASONING if opened or self._state == _OPENER else _CONTENT
            elif self._state == _REASONING:
                before, marker, after = split_at_marker(buffer, (self._end, *self._terminators))
                out.reasoning += before
                if marker is None:
                    self._held = after
                    return out
                self._state = _CONTENT
                buffer = after if marker == self._end else marker + after
            else:
                out.content += buffer
                return out
        return out

    def finish(self, finish_reason: str) -> ParsedDelta:
        held, self._held = self._held, ""
        if self._state in (_OPENER, _REASONING):
            markers = (self._start_marker,) if self._state == _OPENER else (self._end, *self._terminators)
            return ParsedDelta(reasoning=released_at_finish(held, markers, finish_reason))
        return ParsedDelta(content=released_at_finish(held, (self._start_marker,), finish_reason))
