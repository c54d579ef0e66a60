"""Output parsers by name (model.reasoning_parser / model.tool_parser): a new format is one module plus a
registry line here and one config line in conf/model/."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from deltafin.prompt.parsers.base import (
    IdFactory,
    kimi_call_ids,
    OutputParser,
    ParsedDelta,
    PlainOutputParser,
    ToolCallDelta,
    random_call_id,
    schema_types,
)
from deltafin.prompt.parsers.glm import CALL_BEGIN as GLM_CALL_BEGIN
from deltafin.prompt.parsers.glm import GlmToolParser
from deltafin.prompt.parsers.kimi_k2 import SECTION_BEGIN as K2_SECTION_BEGIN
from deltafin.prompt.parsers.kimi_k2 import CALL_BEGIN as K2_CALL_BEGIN
from deltafin.prompt.parsers.kimi_k2 import KimiK2ToolParser
from deltafin.prompt.parsers.kimi_k3 import KimiK3Parser, starting_channels
from deltafin.prompt.parsers.think import ThinkReasoningParser

__all__ = [
    "OutputParser", "ParsedDelta", "ToolCallDelta", "build_output_parser", "check_parser_names", "REASONING_PARSERS", "TOOL_PARSERS",
]


def _think(terminators: Sequence[str]) -> Callable[[str], Any]:
    def make(prompt_text: str) -> ThinkReasoningParser:
        prefilled = prompt_text.rstrip().endswith("<think>")
        return ThinkReasoningParser(start="<think>", end="</think>", terminators=terminators, starts_in_reasoning=prefilled)

    return make


#: name -> factory(prompt_text) of a reasoning parser
REASONING_PARSERS: dict[str, Callable[[str], Any]] = {
    "kimi_k2": _think((*K2_SECTION_BEGIN, K2_CALL_BEGIN)),
    "glm45": _think((GLM_CALL_BEGIN,)),
    "glm47": _think((GLM_CALL_BEGIN,)),
}

#: name -> factory(tools, new_id) of a tool-call parser (fed the answer text the reasoning parser lets through)
TOOL_PARSERS: dict[str, Callable[[Sequence[Any], IdFactory], Any]] = {
    "kimi_k2": lambda tools, new_id: KimiK2ToolParser(list(schema_types(tools)), new_id),
    "glm45": lambda tools, new_id: GlmToolParser(newline_after_name=True, types=schema_types(tools), new_id=new_id),
    "glm47": lambda tools, new_id: GlmToolParser(newline_after_name=False, types=schema_types(tools), new_id=new_id),
}

#: formats whose reasoning and tool calls are one grammar, parsed together
COMBINED_PARSERS = {"kimi_k3"}

#: formats whose tool-call ids are Kimi's `functions.NAME:IDX` (others get random `call_...` ids)
KIMI_ID_FORMATS = {"kimi_k2", "kimi_k3"}


class ChainedParser:
    """Reasoning parser first; the answer text it lets through goes to the tool-call parser."""

    def __init__(self, reasoning: Any | None, tools: Any | None) -> None:
        self._reasoning = reasoning
        self._tools = tools

    def _tools_on(self, delta: ParsedDelta, feed: Callable[[str], ParsedDelta]) -> ParsedDelta:
        if self._tools is None or not delta.content:
            return delta
        parsed = feed(delta.content)
        delta.content = parsed.content
        delta.tool_calls.extend(parsed.tool_calls)
        return delta

    def feed(self, text: str) -> ParsedDelta:
        delta = self._reasoning.feed(text) if self._reasoning else ParsedDelta(content=text)
        return self._tools_on(delta, self._tools.feed if self._tools else None)

    def finish(self, finish_reason: str) -> ParsedDelta:
        delta = self._reasoning.finish(finish_reason) if self._reasoning else ParsedDelta()
        if delta.reasoning_retracted:
            return delta
        delta = self._tools_on(delta, self._tools.feed if self._tools else None)
        if self._tools is not None:
            delta.extend(self._tools.finish(finish_reason))
        return delta


def known_parser_names() -> set[str]:
    return set(REASONING_PARSERS) | set(TOOL_PARSERS) | COMBINED_PARSERS


def check_parser_names(reasoning: str | None, tools: str | None) -> None:
    """Start-up check of model.reasoning_parser / model.tool_parser."""
    from deltafin.config import ConfigError

    known = known_parser_names()
    for key, name in (("model.reasoning_parser", reasoning), ("model.tool_parser", tools)):
        if name is not None and name not in known:
            raise ConfigError(f"{key}: unknown parser {name!r} (known: {', '.join(sorted(known))})")


def build_output_parser(
    reasoning: str | None,
    tools: str | None,
    *,
    prompt_text: str = "",
    tool_schemas: Sequence[Any] | None = None,
    history_calls: int = 0,
    new_id: IdFactory | None = None,
) -> OutputParser:
    """A fresh parser for one choice. `prompt_text` tells where output starts (inside reasoning or not);
    `history_calls` (tool calls in earlier assistant messages) numbers Kimi-style ids."""
    check_parser_names(reasoning, tools)
    if new_id is None:
        new_id = kimi_call_ids(history_calls) if tools in KIMI_ID_FORMATS else random_call_id
    if reasoning in COMBINED_PARSERS or tools in COMBINED_PARSERS:
        return KimiK3Parser(channels=starting_channels(prompt_text), new_id=new_id)
    if reasoning is None and tools is None:
        return PlainOutputParser()
    reasoning_parser = REASONING_PARSERS[reasoning](prompt_text) if reasoning else None
    tool_parser = TOOL_PARSERS[tools](tool_schemas or (), new_id) if tools else None
    return ChainedParser(reasoning_parser, tool_parser)
