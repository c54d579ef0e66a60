"""Tool-call markups: how a model writes its reasoning and tool calls, one module per markup, each holding its
parser (whole text and stream: `feed` / `finish`), the structural tag that forces it, its style for
llama-server's GBNF, and a writer the tests derive their cases from (deltafin.markup.base).

    xtml         Kimi K3 XTML channels (reasoning and calls, one grammar)
    kimi_k2      Kimi K2 tool sections after `<think>`
    glm45 glm47  GLM XML calls after `<think>` (GLM-4.5/4.6; GLM-4.7/5)
    hermes       Hermes / Qwen3 `<tool_call>` JSON after `<think>`
    forced_json  calls forced as plain JSON on a family without a markup

Shared pieces: `parsing` (what a parser emits, marker scanning), `chain` (reasoning then calls), `think`
(the `<think>` block), `values` (raw argument values), `formats` (structural-tag constructors), `selection`
(which calls a request forces), `xml_args` (arguments one property at a time). A family names its markup
(deltafin.families); a new markup is one module here: the package imports every module in it.
"""

from __future__ import annotations

import importlib
import pkgutil

from deltafin.markup.base import MARKUPS, Markup, ReasoningMarkers, XmlArgumentStyle
from deltafin.markup.parsing import IdFactory, OutputParser, ParsedDelta, PlainOutputParser, ToolCallDelta

__all__ = [
    "MARKUPS",
    "IdFactory",
    "Markup",
    "OutputParser",
    "ParsedDelta",
    "PlainOutputParser",
    "ReasoningMarkers",
    "ToolCallDelta",
    "XmlArgumentStyle",
    "get_markup",
]


def get_markup(name: str) -> Markup:
    try:
        return MARKUPS[name]
    except KeyError:
        raise ValueError(f"{name!r} is not a known markup ({', '.join(sorted(MARKUPS))})") from None


for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
