"""Kimi K3 XTML tool calls, as deltafin.prompt.parsers.kimi_k3 reads them:

    [reasoning]<|close|>think<|sep|>  or  <|close|>response<|sep|>      (closes the channel the prompt opened)
    <|open|>tools<|sep|>
      <|open|>call tool="NAME" index="N"<|sep|>
        <|open|>argument key="K" type="T"<|sep|>VALUE<|close|>argument<|sep|>...
      <|close|>call<|sep|>...
    <|close|>tools<|sep|><|close|>message<|sep|>

Arguments use xgrammar's `kimi_k3_xml` style. Its builtin "kimi_k3" tag always puts a response channel
(any text) before the tools; a forced call here comes straight after the prompt's channel closes, so a model
cannot talk its way past the call.
"""

from __future__ import annotations

from typing import Any

from deltafin.grammar.tool_calls.formats import arguments, calls, const, regex, sequence, structural_tag, tag, think_prefix
from deltafin.grammar.tool_calls.selection import ForcedCalls

OPEN, CLOSE, SEP = "<|open|>", "<|close|>", "<|sep|>"


def _attr(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


def xtml_structure(forced: ForcedCalls, *, reasoning: str) -> dict[str, Any]:
    """reasoning: "enabled" when the prompt opened the think channel, else the response channel is open."""
    tags = [
        tag(
            f'{OPEN}call tool="{_attr(f.name)}" index="',
            sequence(regex(r"[0-9]{1,4}"), const(f'"{SEP}'), arguments(dict(f.schema), "kimi_k3_xml", (OPEN, CLOSE, SEP))),
            f"{CLOSE}call{SEP}",
        )
        for f in forced.functions
    ]
    opened = (
        think_prefix("enabled", "", f"{CLOSE}think{SEP}", (OPEN, CLOSE))
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


