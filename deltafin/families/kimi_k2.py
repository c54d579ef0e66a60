"""Kimi K2 / K2.5 / K2.6: the checkpoint's template, `<think>` reasoning (prefilled when thinking is on,
K2.5+), tool sections with `functions.NAME:IDX` ids reported verbatim."""

from __future__ import annotations

from typing import Any, Sequence

from deltafin.families import register
from deltafin.families.base import ModelFamily, TinyRecipe
from deltafin.grammar.tool_calls import KIMI_K2, Syntax
from deltafin.prompt.parsers.base import IdFactory
from deltafin.prompt.parsers.kimi_k2 import CALL_BEGIN, SECTION_BEGIN, KimiK2ToolParser
from deltafin.prompt.parsers.think import ThinkReasoningParser
from deltafin.prompt.parsers.values import tool_properties

TOKENS = [
    "<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>",
    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_section_begin|>",
    "<|tool_call_section_end|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
    "<think>", "</think>", "<|pad|>",
]


@register
class KimiK2(ModelFamily):
    name = "kimi_k2"
    kimi_ids = True

    def reasoning_parser(self, variant: str | None, prompt_text: str) -> ThinkReasoningParser:
        # A tool section opened inside reasoning ends it (seen in the wild without </think>).
        return ThinkReasoningParser(
            start="<think>", end="</think>", terminators=(*SECTION_BEGIN, CALL_BEGIN),
            starts_in_reasoning=prompt_text.rstrip().endswith("<think>"),
        )

    def tool_parser(self, variant: str | None, tools: Sequence[Any], new_id: IdFactory) -> KimiK2ToolParser:
        return KimiK2ToolParser(tool_properties(tools), new_id)

    def grammar(self, variant: str | None) -> Syntax:
        return KIMI_K2

    def tiny_recipe(self, variant: str | None) -> TinyRecipe:
        return TinyRecipe("deepseek_v3", TOKENS, ["<|im_end|>"], "kimi_k2.jinja")
