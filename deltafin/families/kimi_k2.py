"""Kimi K2 / K2.5 / K2.6: the checkpoint's template, `<think>` reasoning (prefilled when thinking is on,
K2.5+), tool sections with `functions.NAME:IDX` ids reported verbatim."""

from __future__ import annotations

from deltafin.families import register
from deltafin.families.base import ModelFamily, TinyRecipe
from deltafin.markup.kimi_k2 import KIMI_K2
from deltafin.markup.kimi_k2 import KimiK2 as KimiK2Markup

TOKENS = [
    "<|im_system|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_middle|>",
    "<|im_end|>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_section_begin|>",
    "<|tool_call_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<think>",
    "</think>",
    "<|pad|>",
]


@register
class KimiK2(ModelFamily):
    name = "kimi_k2"
    kimi_ids = True

    def markup(self, variant: str | None) -> KimiK2Markup:
        return KIMI_K2

    def tiny_recipe(self, variant: str | None) -> TinyRecipe:
        return TinyRecipe("deepseek_v3", TOKENS, ["<|im_end|>"], "kimi_k2.jinja")
