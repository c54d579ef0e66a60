"""Reasoning between a start and an end marker (`<think>` ... `</think>`), the rest is answer text: its parser,
its grammar, and `ThinkMarkup`, the base of the markups whose calls follow such a block (Kimi K2 sections,
GLM XML, Hermes JSON). The prompt decides where output starts: a prompt ending in the start marker
(a prefilled `<think>`: K2.5+, GLM-4.7 with thinking on) starts inside reasoning, and a model that writes
the opener again anyway has it dropped; otherwise the model may open reasoning itself at the very start
(GLM-4.5, Qwen3). Reasoning still open when generation ends stays reasoning (as vLLM and SGLang do).
`terminators` (e.g. `<tool_call>`) also end reasoning but stay in the text for the tool parser: a tool call
opened inside reasoning ends it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from deltafin.markup.base import Markup, ReasoningMarkers
from deltafin.markup.chain import BlankContentBesideCalls, ChainedParser
from deltafin.markup.formats import Format, regex, sequence, structural_tag, think_prefix
from deltafin.markup.parsing import IdFactory, OutputParser, ParsedDelta, released_at_finish, split_at_marker
from deltafin.markup.selection import ForcedCalls

START, END = "<think>", "</think>"

# _START: the model may open reasoning; _OPENER: reasoning is open and a repeated opener is dropped.
_START, _OPENER, _REASONING, _CONTENT = "start", "opener", "reasoning", "content"


class ThinkReasoningParser:
    def __init__(self, *, start: str, end: str, terminators: Sequence[str] = (), starts_in_reasoning: bool) -> None:
        self._start_marker = start
        self._end = end
        self._terminators = tuple(terminators)
        self._state = _OPENER if starts_in_reasoning else _START
        self._held = ""
        self._blank: list[str] = []  # whitespace fed while the opener is not known yet, in pieces (joined once)

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        if self._state in (_START, _OPENER) and not text.strip() and not self._held.strip():
            self._blank.append(text)  # a long run of leading whitespace stays linear
            return out
        buffer = self._held + "".join(self._blank) + text
        self._held, self._blank = "", []
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
        held, self._held, self._blank = self._held + "".join(self._blank), "", []
        if self._state in (_OPENER, _REASONING):
            markers = (self._start_marker,) if self._state == _OPENER else (self._end, *self._terminators)
            return ParsedDelta(reasoning=released_at_finish(held, markers, finish_reason))
        return ParsedDelta(content=released_at_finish(held, (self._start_marker,), finish_reason))


def think_reasoning(prompt_text: str) -> str:
    """`<think>...</think>` markups: the prompt ends inside an opened block (enabled), after an empty one
    (disabled, thinking off), or before any (auto: the model may open one itself, as GLM-4.5 and Qwen3 do)."""
    tail = prompt_text.rstrip()
    if tail.endswith(START):
        return "enabled"
    if tail.endswith(END):
        return "disabled"
    return "auto"


def think_answer(content: Format, reasoning: str, excludes: tuple[str, ...] = (START, END)) -> dict[str, Any]:
    return structural_tag(
        sequence(
            think_prefix(reasoning, START, END, excludes),
            regex(r"\n{0,2}") if reasoning != "disabled" else None,
            content,
        )
    )


class ThinkMarkup(Markup):
    """Reasoning in a `<think>` block, then the answer, whose tool calls each subclass reads and forces.

    A call opened inside reasoning ends it (`call_openers` are the reasoning parser's terminators). A forced
    output is the reasoning block the prompt left open, a newline or two, then the calls, and nothing else."""

    #: what opens a call (or a section of calls)
    call_openers: ClassVar[tuple[str, ...]]
    #: what the reasoning block of a forced output may not contain
    reasoning_excludes: ClassVar[tuple[str, ...]]
    #: what the reasoning block before a constrained answer may not contain
    answer_excludes: ClassVar[tuple[str, ...]] = (START, END)
    prompt_endings: ClassVar[dict[str, str]] = {"enabled": START, "disabled": START + END, "auto": ""}

    def tool_parser(self, tools: Sequence[Any], new_id: IdFactory) -> OutputParser:
        """A fresh tool-call parser for one choice, fed the answer text the reasoning parser lets through."""
        raise NotImplementedError

    def call_formats(self, forced: ForcedCalls) -> list[Format]:
        """The forced calls, as the formats that follow the reasoning block."""
        raise NotImplementedError

    def write_calls(self, calls: Sequence[Any]) -> str:
        raise NotImplementedError

    def output_parser(
        self,
        *,
        prompt_text: str,
        tools: Sequence[Any],
        calls_allowed: bool,
        new_id: IdFactory,
        forced: ForcedCalls | None = None,
    ) -> OutputParser:
        # Where reasoning starts is read off the prompt (a prefilled `<think>`: K2.5+, GLM-4.7, Qwen3 thinking-only).
        reasoning = ThinkReasoningParser(
            start=START,
            end=END,
            terminators=self.call_openers,
            starts_in_reasoning=prompt_text.rstrip().endswith(START),
        )
        calls = self.tool_parser(tools, new_id) if calls_allowed else None
        chained = ChainedParser(reasoning, calls)
        return BlankContentBesideCalls(chained) if calls is not None else chained

    def reasoning(self, prompt_text: str) -> str:
        return think_reasoning(prompt_text)

    def reasoning_markers(self) -> ReasoningMarkers:
        # A call opened inside reasoning ends it, for the parser and so for a budget.
        return ReasoningMarkers(start=START, ends=(END, *self.call_openers), forced=END)

    def answer(self, content: Format, reasoning: str) -> dict[str, Any]:
        return think_answer(content, reasoning, self.answer_excludes)

    def calls(self, forced: ForcedCalls, reasoning: str) -> dict[str, Any]:
        return structural_tag(
            sequence(
                think_prefix(reasoning, START, END, self.reasoning_excludes),
                regex(r"\n{0,2}") if reasoning != "disabled" else None,  # a newline or two may follow </think>
                *self.call_formats(forced),
            )
        )

    def write(
        self, calls: Sequence[Any], *, reasoning: str = "disabled", thought: str = "", forced: ForcedCalls | None = None
    ) -> str:
        opened = {"enabled": f"{thought}{END}\n", "auto": f"{START}{thought}{END}\n" if thought else ""}
        return opened.get(reasoning, "") + self.write_calls(calls)
