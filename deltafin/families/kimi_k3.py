"""Kimi K3: XTML channels rendered by Deltafin (K3 ships no Jinja template); reasoning and tool calls are
channels of one grammar, parsed together; ids `functions.NAME:IDX` counted over the conversation."""

from __future__ import annotations

from deltafin.families import register
from deltafin.families.base import ModelFamily, TinyRecipe
from deltafin.markup.xtml import XTML, Xtml

TOKENS = ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "<|pad|>"]


@register
class KimiK3(ModelFamily):
    name = "kimi_k3"
    chat_format = "xtml"
    kimi_ids = True

    def markup(self, variant: str | None) -> Xtml:
        return XTML

    def tiny_recipe(self, variant: str | None) -> TinyRecipe:
        return TinyRecipe("kimi_k3", TOKENS, ["<|end_of_msg|>"])
