"""GLM: the checkpoint's template, `<think>` reasoning and `<tool_call>` calls with raw `<arg_value>`s typed
from the tool schema. Two variants (`model.variant`):

- `glm45` (GLM-4.5 / 4.6, the default): the model opens `<think>` itself; a newline ends a call's name.
- `glm47` (GLM-4.7 / 5): `<think>` is prefilled; no newline after the name, zero-argument calls
  (`<tool_call>now</tool_call>`) and text between calls.
"""

from __future__ import annotations

from deltafin.families import register
from deltafin.families.base import ModelFamily, TinyRecipe
from deltafin.markup.glm import GLM45, GLM47
from deltafin.markup.glm import Glm as GlmMarkup

TOKENS = [
    "[gMASK]",
    "<sop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|endoftext|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "<tool_response>",
    "</tool_response>",
]


@register
class Glm(ModelFamily):
    name = "glm"
    variants = ("glm45", "glm47")

    def markup(self, variant: str | None) -> GlmMarkup:
        return GLM45 if variant == "glm45" else GLM47

    def tiny_recipe(self, variant: str | None) -> TinyRecipe:
        switch = "{%- set glm47 = " + ("true" if variant == "glm47" else "false") + " -%}"
        return TinyRecipe("glm4_moe", TOKENS, ["<|endoftext|>", "<|user|>", "<|observation|>"], "glm.jinja", switch)
