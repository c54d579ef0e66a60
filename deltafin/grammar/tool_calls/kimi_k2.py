"""Kimi K2 sections, as deltafin.prompt.parsers.kimi_k2 reads them:

    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{JSON}<|tool_call_end|>...<|tool_calls_section_end|>

Same strings as xgrammar's builtin "kimi" tag; ours bounds IDX to 4 digits (an unbounded `\\d+` lets a weak
model write digits forever) and lets no text stand before a forced section.
"""

from __future__ import annotations

from typing import Any

from deltafin.grammar.tool_calls.formats import arguments, calls, const, regex, sequence, structural_tag, tag, think_prefix
from deltafin.grammar.tool_calls.selection import ForcedCalls
from deltafin.grammar.tool_calls.syntax import Syntax, think_answer, think_reasoning

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGS_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def kimi_k2_structure(forced: ForcedCalls, *, reasoning: str) -> dict[str, Any]:
    tags = [
        tag(
            f"{CALL_BEGIN}functions.{f.name}:",
            sequence(regex(r"[0-9]{1,4}"), const(ARGS_BEGIN), arguments(dict(f.schema))),
            CALL_END,
        )
        for f in forced.functions
    ]
    return structural_tag(
        sequence(
            think_prefix(reasoning, "<think>", "</think>", ("<think>", "</think>", SECTION_BEGIN)),
            regex(r"\n{0,2}") if reasoning != "disabled" else None,  # a newline or two may follow </think>
            const(SECTION_BEGIN),
            calls(tags, "", single=forced.single),
            const(SECTION_END),
        )
    )


KIMI_K2 = Syntax(
    calls=lambda forced, reasoning: kimi_k2_structure(forced, reasoning=reasoning),
    answer=think_answer,
    reasoning=think_reasoning,
)
