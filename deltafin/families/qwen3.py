"""Qwen3: the checkpoint's ChatML template, `<think>` reasoning (the model opens it itself; thinking-only
checkpoints prefill it) and Hermes-style calls, a JSON object between `<tool_call>` tags."""

from __future__ import annotations

from typing import Any, Sequence

from deltafin.families import register
from deltafin.families.base import ModelFamily, TinyRecipe
from deltafin.grammar.tool_calls import HERMES, Syntax
from deltafin.prompt.parsers.base import IdFactory
from deltafin.prompt.parsers.hermes import CALL_BEGIN, HermesToolParser
from deltafin.prompt.parsers.think import ThinkReasoningParser

TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
    "<tool_response>", "</tool_response>",
]


@register
class Qwen3(ModelFamily):
    name = "qwen3"

    def reasoning_parser(self, variant: str | None, prompt_text: str) -> ThinkReasoningParser:
        return ThinkReasoningParser(
            start="<think>", end="</think>", terminators=(CALL_BEGIN,),
            starts_in_reasoning=prompt_text.rstrip().endswith("<think>"),
        )

    def tool_parser(self, variant: str | None, tools: Sequence[Any], new_id: IdFactory) -> HermesToolParser:
        return HermesToolParser(new_id)

    def grammar(self, variant: str | None) -> Syntax:
        return HERMES

    def tiny_recipe(self, variant: str | None) -> TinyRecipe:
        return TinyRecipe("qwen3", TOKENS, ["<|im_end|>", "<|endoftext|>"], "qwen3.jinja")
