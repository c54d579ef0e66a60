"""Hermes / Qwen3 tool calls, as the hermes parser reads them:

    <tool_call>\\n{"name": "NAME", "arguments": {JSON}}\\n</tool_call>

The same strings as xgrammar's builtin "qwen_3" tag; ours lets no text stand before a required call.
"""

from __future__ import annotations

import json
from typing import Any

from deltafin.grammar.tool_calls.formats import arguments, calls, regex, sequence, structural_tag, tag, think_prefix
from deltafin.grammar.tool_calls.selection import ForcedCalls
from deltafin.grammar.tool_calls.syntax import Syntax, think_answer, think_reasoning


def hermes_structure(forced: ForcedCalls, *, reasoning: str) -> dict[str, Any]:
    tags = [
        tag(f'<tool_call>\n{{"name": {json.dumps(f.name)}, "arguments": ', arguments(dict(f.schema)), "}\n</tool_call>")
        for f in forced.functions
    ]
    return structural_tag(
        sequence(
            think_prefix(reasoning, "<think>", "</think>", ("<think>", "</think>", "<tool_call>")),
            regex(r"\n{0,2}") if reasoning != "disabled" else None,
            calls(tags, "\n", single=forced.single),
        )
    )


HERMES = Syntax(
    calls=lambda forced, reasoning: hermes_structure(forced, reasoning=reasoning),
    answer=think_answer,
    reasoning=think_reasoning,
)
