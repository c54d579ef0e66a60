"""A model family: everything Deltafin knows about one family of checkpoints, in one class.

A family names its chat format and its markup (deltafin.markup: the parser, the grammar that forces its tool
calls and its llama-server form, in one object), says whether tool-call ids are Kimi-style, and holds the
recipe of a tiny model for tests. Families that differ only in small ways (GLM-4.5 vs 4.7) are one family with
`variants`, chosen by `model.variant`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from deltafin.markup import IdFactory, Markup, OutputParser, PlainOutputParser
from deltafin.markup.parsing import kimi_call_ids, random_call_id
from deltafin.markup.selection import forced_calls


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

    def markup(self, variant: str | None) -> Markup | None:
        """How this family writes reasoning and tool calls (deltafin.markup); None: every output character is
        answer content and no call can be chosen (a forced call is then plain JSON: deltafin.markup.forced_json)."""
        return None

    def output_parser(
        self, variant: str | None, *, prompt_text: str, tools: Sequence[Any], calls_allowed: bool, new_id: IdFactory
    ) -> OutputParser:
        """A fresh parser for one choice; tool calls are read only when `calls_allowed`."""
        markup = self.markup(variant)
        if markup is None:
            return PlainOutputParser()
        return markup.output_parser(prompt_text=prompt_text, tools=tools, calls_allowed=calls_allowed, new_id=new_id)

    def tiny_recipe(self, variant: str | None) -> TinyRecipe | None:
        """The tiny test model of this family (None: the family has none)."""
        return None

    def parses_tool_calls(self, variant: str | None) -> bool:
        """The family reads tool calls the model chose to write; `tools` sent to a family that does not are
        refused unless a call is forced."""
        markup = self.markup(variant)
        return markup is not None and markup.chooses_calls

    def tool_call_structure(
        self,
        variant: str | None,
        tools: Sequence[Any],
        tool_choice: Any,
        *,
        prompt_text: str,
        parallel_tool_calls: bool | None = None,
    ) -> dict[str, Any] | None:
        """An xgrammar structural tag forcing this family's native tool-call syntax when `tool_choice` forces a
        call ("required" or a named function), after any reasoning block the prompt leaves open; None when
        nothing is forced or the family has no markup. ValueError: the named function is not in `tools`."""
        markup = self.markup(variant)
        forced = forced_calls(tools, tool_choice, parallel_tool_calls=parallel_tool_calls)
        if markup is None or forced is None:
            return None
        return markup.calls(forced, markup.reasoning(prompt_text))

    def answer_structure(
        self, variant: str | None, content: dict[str, Any], *, prompt_text: str
    ) -> dict[str, Any] | None:
        """A structural tag letting this family's reasoning through, then `content` (an xgrammar format, e.g.
        JSON under a schema) as the answer; None when the output starts with the answer (no open reasoning)."""
        markup = self.markup(variant)
        if markup is None:
            return None
        reasoning = markup.reasoning(prompt_text)
        return None if reasoning == "disabled" else markup.answer(content, reasoning)


@dataclass(frozen=True)
class BoundFamily:
    """A family bound to its variant once, when a model loads: what serving asks of the served model's family
    (its markup, parser, grammars) without looking up the family or resolving the variant per request."""

    family: ModelFamily
    variant: str | None
    markup: Markup | None = field(init=False)
    #: the model chooses tool calls itself (else `tools` need a forced tool_choice)
    parses_tool_calls: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "markup", self.family.markup(self.variant))
        object.__setattr__(self, "parses_tool_calls", self.family.parses_tool_calls(self.variant))

    @property
    def name(self) -> str:
        return self.family.name

    def output_parser(
        self,
        *,
        prompt_text: str = "",
        tool_schemas: Sequence[Any] | None = None,
        calls_allowed: bool | None = None,
        history_calls: int = 0,
        new_id: IdFactory | None = None,
    ) -> OutputParser:
        """A fresh parser for one choice. `prompt_text` tells where output starts (inside reasoning or not);
        tool calls are parsed only when `calls_allowed` (default: when tools are declared); `history_calls`
        (tool calls in earlier assistant messages) numbers Kimi-style ids."""
        if new_id is None:
            new_id = kimi_call_ids(history_calls) if self.family.kimi_ids else random_call_id
        allowed = bool(tool_schemas) if calls_allowed is None else calls_allowed
        return self.family.output_parser(
            self.variant, prompt_text=prompt_text, tools=tool_schemas or (), calls_allowed=allowed, new_id=new_id
        )

    def tool_call_structure(
        self, tools: Sequence[Any], tool_choice: Any, *, prompt_text: str, parallel_tool_calls: bool | None = None
    ) -> dict[str, Any] | None:
        return self.family.tool_call_structure(
            self.variant, tools, tool_choice, prompt_text=prompt_text, parallel_tool_calls=parallel_tool_calls
        )

    def answer_structure(self, content: dict[str, Any], *, prompt_text: str) -> dict[str, Any] | None:
        return self.family.answer_structure(self.variant, content, prompt_text=prompt_text)
