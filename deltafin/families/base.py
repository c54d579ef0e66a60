"""A model family: everything Deltafin knows about one family of checkpoints, in one class.

A family names its chat format, builds its reasoning and tool-call parsers, says whether tool-call ids are
Kimi-style, describes the grammar that forces its tool-call syntax, and holds the recipe of a tiny model
for tests. Families that differ only in small ways (GLM-4.5 vs 4.7) are one family with `variants`,
chosen by `model.variant`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

from deltafin.grammar.tool_calls import Syntax, forced_calls
from deltafin.prompt.parsers.base import IdFactory, OutputParser, PlainOutputParser, random_call_id
from deltafin.prompt.parsers.chain import BlankContentBesideCalls, ChainedParser


@dataclass(frozen=True)
class TinyRecipe:
    """How `python -m deltafin.tiny` builds a tiny random-weight model of the family."""

    # the family's transformers architecture, scaled down: a builder in deltafin/tiny/architectures.py, by name
    # (named, not imported: deltafin.tiny stands above the families and imports them)
    model: str
    special_tokens: list[str]  # the last one named "pad" (if any) is the padding token
    stop_tokens: list[str]  # the first is the tokenizer's eos_token
    template: str | None = None  # file in deltafin/tiny/templates; None: Deltafin renders the prompt itself
    template_prefix: str = ""  # Jinja prepended to the template (e.g. a variant switch)


class ModelFamily:
    name: ClassVar[str]
    #: the chat format conf/model/*.yaml selects (`template`: the checkpoint's Jinja; `xtml`: Deltafin's own)
    chat_format: ClassVar[str] = "template"
    #: allowed `model.variant` values, the first one the default; empty: the family has no variants
    variants: ClassVar[tuple[str, ...]] = ()
    #: tool-call ids are Kimi's `functions.NAME:IDX`, IDX counted over the conversation (else `call_...`)
    kimi_ids: ClassVar[bool] = False

    def variant(self, variant: str | None) -> str | None:
        """The variant to use for `model.variant` (None: the default); ValueError for an unknown one."""
        if variant is None:
            return self.variants[0] if self.variants else None
        if variant not in self.variants:
            known = ", ".join(self.variants) or "none"
            raise ValueError(f"model.variant: {variant!r} is not a variant of family {self.name!r} (known: {known})")
        return variant

    def reasoning_parser(self, variant: str | None, prompt_text: str) -> Any | None:
        """A fresh reasoning parser for one choice; `prompt_text` tells whether output starts inside reasoning."""
        return None

    def tool_parser(self, variant: str | None, tools: Sequence[Any], new_id: IdFactory) -> Any | None:
        """A fresh tool-call parser for one choice, fed the answer text the reasoning parser lets through."""
        return None

    def output_parser(
        self, variant: str | None, *, prompt_text: str, tools: Sequence[Any], calls_allowed: bool, new_id: IdFactory
    ) -> OutputParser:
        """Reasoning then tool calls (these only when `calls_allowed`); families whose reasoning and calls are
        one grammar override this."""
        reasoning = self.reasoning_parser(variant, prompt_text)
        calls = self.tool_parser(variant, tools, new_id) if calls_allowed else None
        if reasoning is None and calls is None:
            return PlainOutputParser()
        chained = ChainedParser(reasoning, calls)
        return BlankContentBesideCalls(chained) if calls is not None else chained

    def tiny_recipe(self, variant: str | None) -> TinyRecipe | None:
        """The tiny test model of this family (None: the family has none)."""
        return None

    def grammar(self, variant: str | None) -> Syntax | None:
        """The grammar of this family's output (deltafin.grammar.tool_calls.Syntax), kept beside the parser that
        reads the same syntax back (as SGLang keeps `build_ebnf` / `structure_info` on its format detectors);
        None: nothing to force (no tool-call syntax)."""
        return None

    def parses_tool_calls(self, variant: str | None) -> bool:
        """The family reads tool calls from output; `tools` sent to a family that does not are refused."""
        return self.tool_parser(variant, (), random_call_id) is not None

    def tool_call_structure(
        self, variant: str | None, tools: Sequence[Any], tool_choice: Any, *, prompt_text: str,
        parallel_tool_calls: bool | None = None,
    ) -> dict[str, Any] | None:
        """An xgrammar structural tag forcing this family's native tool-call syntax when `tool_choice` forces a
        call ("required" or a named function), after any reasoning block the prompt leaves open; None when
        nothing is forced or the family has no grammar. ValueError: the named function is not in `tools`."""
        syntax = self.grammar(variant)
        forced = forced_calls(tools, tool_choice, parallel_tool_calls=parallel_tool_calls)
        if syntax is None or forced is None:
            return None
        return syntax.calls(forced, syntax.reasoning(prompt_text))

    def answer_structure(self, variant: str | None, content: dict[str, Any], *, prompt_text: str) -> dict[str, Any] | None:
        """A structural tag letting this family's reasoning through, then `content` (an xgrammar format, e.g.
        JSON under a schema) as the answer; None when the output starts with the answer (no open reasoning)."""
        syntax = self.grammar(variant)
        if syntax is None:
            return None
        reasoning = syntax.reasoning(prompt_text)
        return None if reasoning == "disabled" else syntax.answer(content, reasoning)
