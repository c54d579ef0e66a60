"""Kimi K3 XTML tool calls, as deltafin.prompt.parsers.kimi_k3 reads them and deltafin.prompt.xtml renders them:

    [reasoning]<|close|>think<|sep|>  or  <|close|>response<|sep|>      (closes the channel the prompt opened)
    <|open|>tools<|sep|>
      <|open|>call tool="NAME" index="N"<|sep|>
        <|open|>argument key="K" type="T"<|sep|>VALUE<|close|>argument<|sep|>...
      <|close|>call<|sep|>...
    <|close|>tools<|sep|><|close|>message<|sep|>

T is the value's JSON type as K3's encoder names it (`string`: raw text; `number` for integers and floats alike;
anything else: JSON). With thinking on, an empty response channel stands between the reasoning and the tools, as
K3's encoder writes every assistant turn with calls (deltafin.prompt.xtml). xgrammar's builtin "kimi_k3" tag is
not used: it pads values with whitespace, and its response channel before the tools takes any text, so a model
could talk its way past a forced call. Arguments are laid out by `xml_args`.
"""

from __future__ import annotations

from typing import Any, Mapping

from deltafin.grammar.tool_calls.formats import Format, calls, const, one_of, regex, sequence, structural_tag, tag, think_prefix
from deltafin.grammar.tool_calls.selection import ForcedCalls
from deltafin.grammar.tool_calls.syntax import Syntax
from deltafin.grammar.tool_calls.xml_args import any_key, json_value, per_property, raw_text

OPEN, CLOSE, SEP = "<|open|>", "<|close|>", "<|sep|>"
_MARKERS = (OPEN, CLOSE, SEP)
_ARG_END = f"{CLOSE}argument{SEP}"
_JSON_TYPES = ("integer", "number", "boolean", "null", "array", "object")
_TYPE_NAMES = ("number", "boolean", "null", "array", "object")  # K3's names: an integer is a `number`


def _attr(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


def _value(schema: Mapping[str, Any]) -> Format:
    """`T"<|sep|>VALUE<|close|>argument<|sep|>`, after `type="`."""
    kind = schema.get("type")
    if kind == "string":
        return tag(f'string"{SEP}', raw_text(schema, _MARKERS), _ARG_END)
    if kind in _JSON_TYPES:
        name = "number" if kind == "integer" else kind
        return tag(f'{name}"{SEP}', json_value(schema), _ARG_END)
    # No single declared type: raw text as a string, or a JSON value under the schema with its type named.
    return one_of(
        tag(f'string"{SEP}', raw_text({}, _MARKERS), _ARG_END),
        sequence(regex("|".join(_TYPE_NAMES)), tag(f'"{SEP}', json_value(schema), _ARG_END)),
    )


def _argument(key: str, schema: Mapping[str, Any]) -> Format:
    return sequence(const(f'{OPEN}argument key="{_attr(key)}" type="'), _value(schema))


_ANY_ARGUMENT = sequence(const(f'{OPEN}argument key="'), any_key(), const('" type="'), _value({}))


def xtml_structure(forced: ForcedCalls, *, reasoning: str) -> dict[str, Any]:
    """reasoning: "enabled" when the prompt opened the think channel, else the response channel is open."""
    tags = [
        tag(
            f'{OPEN}call tool="{_attr(f.name)}" index="',
            sequence(regex(r"[0-9]{1,4}"), const(f'"{SEP}'), per_property(f.schema, _argument, _ANY_ARGUMENT)),
            f"{CLOSE}call{SEP}",
        )
        for f in forced.functions
    ]
    opened = (
        sequence(think_prefix("enabled", "", f"{CLOSE}think{SEP}", (OPEN, CLOSE)), const(f"{OPEN}response{SEP}{CLOSE}response{SEP}"))
        if reasoning == "enabled"
        else const(f"{CLOSE}response{SEP}")
    )
    return structural_tag(
        sequence(
            opened,
            const(f"{OPEN}tools{SEP}"),
            calls(tags, "", single=forced.single),
            const(f"{CLOSE}tools{SEP}{CLOSE}message{SEP}"),
        )
    )


def xtml_answer(content: Format, reasoning: str) -> dict[str, Any]:
    """Reasoning (if the prompt opened think), then `content` as the whole response channel."""
    opened = (
        sequence(think_prefix("enabled", "", f"{CLOSE}think{SEP}", (OPEN, CLOSE)), const(f"{OPEN}response{SEP}"))
        if reasoning == "enabled"
        else None
    )
    return structural_tag(sequence(opened, content, const(f"{CLOSE}response{SEP}{CLOSE}message{SEP}")))


def xtml_reasoning(prompt_text: str) -> str:
    """The prompt opens think (thinking on, any effort attribute) or response; K3 never opens think itself."""
    tail = prompt_text.rstrip()
    return "disabled" if tail.endswith(f"{OPEN}response{SEP}") else "enabled"


XTML = Syntax(
    calls=lambda forced, reasoning: xtml_structure(forced, reasoning=reasoning), answer=xtml_answer, reasoning=xtml_reasoning
)
