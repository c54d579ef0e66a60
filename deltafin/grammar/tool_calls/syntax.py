"""A family's output syntax as the grammar sees it: how to force its tool calls, how to let its reasoning
through before a constrained answer, and which reasoning mode a rendered prompt leaves the model in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from deltafin.grammar.tool_calls.formats import Format, regex, sequence, structural_tag, think_prefix
from deltafin.grammar.tool_calls.selection import ForcedCalls


@dataclass(frozen=True)
class Syntax:
    #: (forced calls, reasoning mode) -> structural tag
    calls: Callable[[ForcedCalls, str], dict[str, Any]]
    #: (content format, reasoning mode) -> structural tag: reasoning as the model writes it, then the content
    answer: Callable[[Format, str], dict[str, Any]]
    #: rendered prompt text -> "enabled" | "disabled" | "auto"
    reasoning: Callable[[str], str]


def think_reasoning(prompt_text: str) -> str:
    """`<think>...</think>` families: the prompt ends inside an opened block (enabled), after an empty one
    (disabled, thinking off), or before any (auto: the model may open one itself, as GLM-4.5 and Qwen3 do)."""
    tail = prompt_text.rstrip()
    if tail.endswith("<think>"):
        return "enabled"
    if tail.endswith("</think>"):
        return "disabled"
    return "auto"


def think_answer(content: Format, reasoning: str, excludes: tuple[str, ...] = ("<think>", "</think>")) -> dict[str, Any]:
    return structural_tag(
        sequence(
            think_prefix(reasoning, "<think>", "</think>", excludes),
            regex(r"\n{0,2}") if reasoning != "disabled" else None,
            content,
        )
    )
