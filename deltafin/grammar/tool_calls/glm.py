"""GLM tool calls, as deltafin.prompt.parsers.glm reads them:

    GLM-4.5/4.6:  <tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n</tool_call>
    GLM-4.7/5:    <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>

Arguments use xgrammar's `glm_xml` style (raw string values, JSON for other types), the same as its builtin
"glm_4_7" tag; that builtin has no GLM-4.5 form (newline after the name) and lets text stand before a
required call, so the tag is built here.
"""

from __future__ import annotations

from typing import Any

from deltafin.grammar.tool_calls.formats import arguments, calls, regex, sequence, structural_tag, tag, think_prefix
from deltafin.grammar.tool_calls.selection import ForcedCalls

CALL_BEGIN, CALL_END = "<tool_call>", "</tool_call>"
_MARKERS = ("<think>", "</think>", CALL_BEGIN, CALL_END, "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")


def glm_structure(forced: ForcedCalls, *, reasoning: str, newline_after_name: bool) -> dict[str, Any]:
    newline = "\n" if newline_after_name else ""
    tags = [tag(f"{CALL_BEGIN}{f.name}{newline}", arguments(dict(f.schema), "glm_xml"), CALL_END) for f in forced.functions]
    return structural_tag(
        sequence(
            think_prefix(reasoning, "<think>", "</think>", _MARKERS),
            # GLM writes a newline or two after </think>; nothing else may come before the call.
            regex(r"\n{0,2}") if reasoning != "disabled" else None,
            calls(tags, newline, single=forced.single),
        )
    )
