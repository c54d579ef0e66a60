"""GLM tool calls, as deltafin.prompt.parsers.glm reads them:

    GLM-4.5/4.6:  <tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n</tool_call>
    GLM-4.7/5:    <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>

Values are raw text for strings and JSON otherwise. xgrammar's builtin "glm_4_7" tag is not used: it has no
GLM-4.5 form (newline after the name), its `glm_xml` style pads values with whitespace (which our parser
keeps, as GLM values must be kept), and it lets text stand before a required call.
"""

from __future__ import annotations

from typing import Any, Mapping

from deltafin.grammar.tool_calls.formats import Format, calls, const, regex, sequence, structural_tag, tag, think_prefix
from deltafin.grammar.tool_calls.selection import ForcedCalls
from deltafin.grammar.tool_calls.syntax import Syntax, think_answer, think_reasoning
from deltafin.grammar.tool_calls.xml_args import any_key, json_value, per_property, raw_text

CALL_BEGIN, CALL_END = "<tool_call>", "</tool_call>"
_MARKERS = ("<think>", "</think>", CALL_BEGIN, CALL_END, "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")


def _value(schema: Mapping[str, Any]) -> Format:
    return raw_text(schema, _MARKERS) if schema.get("type") in ("string", None) else json_value(schema)


def glm_structure(forced: ForcedCalls, *, reasoning: str, newline_after_name: bool) -> dict[str, Any]:
    newline = "\n" if newline_after_name else ""

    def argument(key: str, schema: Mapping[str, Any]) -> Format:
        return sequence(
            const(f"<arg_key>{key}</arg_key>{newline}"), tag("<arg_value>", _value(schema), f"</arg_value>{newline}")
        )

    any_argument = sequence(const("<arg_key>"), any_key(), const(f"</arg_key>{newline}"),
                            tag("<arg_value>", raw_text({}, _MARKERS), f"</arg_value>{newline}"))
    tags = [
        tag(f"{CALL_BEGIN}{f.name}{newline}", per_property(f.schema, argument, any_argument), CALL_END)
        for f in forced.functions
    ]
    return structural_tag(
        sequence(
            think_prefix(reasoning, "<think>", "</think>", _MARKERS),
            # GLM writes a newline or two after </think>; nothing else may come before the call.
            regex(r"\n{0,2}") if reasoning != "disabled" else None,
            calls(tags, newline, single=forced.single),
        )
    )


def _glm(newline_after_name: bool) -> Syntax:
    return Syntax(
        calls=lambda forced, reasoning: glm_structure(forced, reasoning=reasoning, newline_after_name=newline_after_name),
        answer=lambda content, reasoning: think_answer(content, reasoning, _MARKERS),
        reasoning=think_reasoning,
    )


GLM45, GLM47 = _glm(True), _glm(False)
