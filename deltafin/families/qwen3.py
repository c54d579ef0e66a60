"""Qwen3: the checkpoint's ChatML template, `<think>` reasoning (the model opens it itself; thinking-only
checkpoints prefill it) and Hermes-style calls, a JSON object between `<tool_call>` tags."""

from __future__ import annotations

from deltafin.families import register
from deltafin.families.base import ModelFamily, TinyRecipe
from deltafin.markup.hermes import HERMES, Hermes

TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]


@register
class Qwen3(ModelFamily):
    name = "qwen3"

    def markup(self, variant: str | None) -> Hermes:
        return HERMES

    def tiny_recipe(self, variant: str | None) -> TinyRecipe:
        return TinyRecipe("qwen3", TOKENS, ["<|im_end|>", "<|endoftext|>"], "qwen3.jinja")
