"""GLM: the checkpoint's template, `<think>` reasoning and `<tool_call>` calls with raw `<arg_value>`s typed
from the tool schema. Two variants (`model.variant`):

- `glm45` (GLM-4.5 / 4.6, the default): the model opens `<think>` itself; a newline ends a call's name.
- `glm47` (GLM-4.7 / 5): `<think>` is prefilled; no newline after the name, zero-argument calls
  (`<tool_call>now</tool_call>`) and text between calls.
"""

from __future__ import annotations

from typing import Any, Sequence

from deltafin.families import register
from deltafin.families.base import ModelFamily, TinyRecipe
from deltafin.grammar.tool_calls import GLM45, GLM47, Syntax
from deltafin.prompt.parsers.base import IdFactory
from deltafin.prompt.parsers.glm import CALL_BEGIN, GlmToolParser
from deltafin.prompt.parsers.think import ThinkReasoningParser
from deltafin.prompt.parsers.values import schema_types

TOKENS = [
    "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<|endoftext|>",
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
    "</arg_value>", "<tool_response>", "</tool_response>",
]


@register
class Glm(ModelFamily):
    name = "glm"
    variants = ("glm45", "glm47")

    def reasoning_parser(self, variant: str | None, prompt_text: str) -> ThinkReasoningParser:
        # Where reasoning starts is read off the prompt, so both variants share one parser.
        return ThinkReasoningParser(
            start="<think>", end="</think>", terminators=(CALL_BEGIN,),
            starts_in_reasoning=prompt_text.rstrip().endswith("<think>"),
        )

    def tool_parser(self, variant: str | None, tools: Sequence[Any], new_id: IdFactory) -> GlmToolParser:
        return GlmToolParser(newline_after_name=variant == "glm45", types=schema_types(tools), new_id=new_id)

    def grammar(self, variant: str | None) -> Syntax:
        return GLM45 if variant == "glm45" else GLM47

    def tiny_recipe(self, variant: str | None) -> TinyRecipe:
        switch = "{%- set glm47 = " + ("true" if variant == "glm47" else "false") + " -%}"
        return TinyRecipe("glm4_moe", TOKENS, ["<|endoftext|>", "<|user|>", "<|observation|>"], "glm.jinja", switch)
