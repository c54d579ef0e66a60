"""Kimi K3: XTML channels rendered by Deltafin (K3 ships no Jinja template); reasoning and tool calls are
channels of one grammar, parsed together; ids `functions.NAME:IDX` counted over the conversation."""

from __future__ import annotations

from typing import Any, Sequence

from deltafin.families import register
from deltafin.families.base import ModelFamily, TinyRecipe
from deltafin.grammar.tool_calls import XTML, Syntax
from deltafin.prompt.parsers.base import IdFactory, OutputParser
from deltafin.prompt.parsers.chain import BlankContentBesideCalls
from deltafin.prompt.parsers.kimi_k3 import KimiK3Parser, starting_channels

TOKENS = ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "<|pad|>"]


@register
class KimiK3(ModelFamily):
    name = "kimi_k3"
    chat_format = "xtml"
    kimi_ids = True

    def output_parser(
        self, variant: str | None, *, prompt_text: str, tools: Sequence[Any], calls_allowed: bool, new_id: IdFactory
    ) -> OutputParser:
        parser = KimiK3Parser(channels=starting_channels(prompt_text), calls_allowed=calls_allowed, new_id=new_id)
        return BlankContentBesideCalls(parser) if calls_allowed else parser

    def grammar(self, variant: str | None) -> Syntax:
        return XTML

    def parses_tool_calls(self, variant: str | None) -> bool:
        return True  # one parser for reasoning and calls (output_parser), no separate tool parser

    def tiny_recipe(self, variant: str | None) -> TinyRecipe:
        return TinyRecipe("kimi_linear", TOKENS, ["<|end_of_msg|>"])
