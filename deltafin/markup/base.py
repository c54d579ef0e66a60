"""What a markup is: everything Deltafin knows about one way a model writes its reasoning and tool calls, in
one object, as SGLang keeps one detector per format (`srt/function_call/base_format_detector.py`: parse,
stream, `structure_info`, `build_ebnf`).

A markup

- reads: `output_parser(...)` builds a fresh parser for one choice (the `feed` / `finish` contract of
  deltafin.markup.parsing: the same code reads a whole text and a stream);
- forces: `calls(forced, reasoning)` is the xgrammar structural tag that makes a model write the forced calls
  in this markup (after the reasoning the prompt left open), `answer(content, reasoning)` lets the reasoning
  through before a constrained answer, `reasoning(prompt_text)` reads off the rendered prompt where output
  starts;
- for llama-server: the structural tag becomes GBNF (deltafin.grammar.gbnf); `markers` are the strings a real
  vocabulary holds as single tokens, which that grammar matches as tokens, and `gbnf_style` is the markup's
  argument style as xgrammar's builtin styles spell it (`glm_xml`, `kimi_k3_xml`), for a structural tag that
  names one;
- writes: `write(...)` is the output its forced grammar lets a model write. The tests derive their cases from
  it (the grammar accepts it, the parser reads the calls back, GBNF agrees with xgrammar), for every
  registered markup.

Families pick a markup (deltafin.families); nothing here knows a family or a model name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from deltafin.markup.formats import Format
from deltafin.markup.parsing import IdFactory, OutputParser
from deltafin.markup.selection import ForcedCalls

#: (function name, its arguments) as a test writes a call
Call = tuple[str, Mapping[str, Any]]


@dataclass(frozen=True)
class XmlArgumentStyle:
    """Arguments written one element per property, as one of xgrammar's builtin `json_schema` styles spells
    them (padded with whitespace, which is why Deltafin's own grammars lay arguments out themselves:
    deltafin.markup.xml_args). deltafin.grammar.gbnf writes it for llama-server."""

    name: str  # the style's name in a structural tag (`"style": NAME`)
    key_open: str
    key_close: str
    value_open: str
    value_close: str
    #: JSON-schema type -> the name written between key and value (K3's `type="..."`); None: no type written
    type_names: Mapping[str, str] | None = None


@dataclass(frozen=True)
class ReasoningMarkers:
    """How a markup's reasoning opens and ends, as a thinking budget needs them (deltafin.serving.thinking_budget):
    where reasoning stops counting, and what ends it when the budget is spent."""

    #: what opens reasoning where the model may open it itself (an "auto" prompt); None: only a prompt opens it
    start: str | None
    #: what ends reasoning as the markup's parser reads it: the end marker, and anything else that ends it there
    #: (a tool call opened inside reasoning)
    ends: tuple[str, ...]
    #: what a spent budget makes the model write: the end marker, then what the model always writes between it
    #: and its answer (K3's response channel opener)
    forced: str


class Markup:
    #: registry name (deltafin.markup.MARKUPS)
    name: str
    #: the markup's control strings; where a vocabulary holds one as a single token, llama-server's grammar
    #: matches the token, never the characters
    markers: tuple[str, ...] = ()
    gbnf_style: XmlArgumentStyle | None = None
    #: the model may decide by itself to call (tool_choice "auto"); False: calls exist only where forced
    chooses_calls: ClassVar[bool] = True
    #: reasoning mode -> how a rendered prompt that leaves output in that mode ends (read by `reasoning`)
    prompt_endings: ClassVar[Mapping[str, str]] = {"disabled": ""}

    def output_parser(
        self,
        *,
        prompt_text: str,
        tools: Sequence[Any],
        calls_allowed: bool,
        new_id: IdFactory,
        forced: ForcedCalls | None = None,
    ) -> OutputParser:
        """A fresh parser for one choice. `prompt_text` tells where output starts; tool calls are read only when
        `calls_allowed`; `forced`: the calls the constraint forces (for markups whose shape depends on it)."""
        raise NotImplementedError

    def reasoning(self, prompt_text: str) -> str:
        """The reasoning mode the rendered prompt leaves the model in: "enabled" (output starts inside
        reasoning), "disabled" (no reasoning) or "auto" (the model may open it itself)."""
        return "disabled"

    def reasoning_markers(self) -> ReasoningMarkers | None:
        """How reasoning opens and ends in this markup; None: the markup has no reasoning."""
        return None

    def calls(self, forced: ForcedCalls, reasoning: str) -> dict[str, Any]:
        """The structural tag forcing `forced` in this markup, after the reasoning `reasoning` leaves open."""
        raise NotImplementedError

    def answer(self, content: Format, reasoning: str) -> dict[str, Any] | None:
        """A structural tag: the reasoning `reasoning` leaves open, then `content` as the answer; None when the
        markup has no reasoning to let through."""
        return None

    def write(
        self,
        calls: Sequence[Call],
        *,
        reasoning: str = "disabled",
        thought: str = "",
        forced: ForcedCalls | None = None,
    ) -> str:
        """The output `calls(forced, reasoning)` lets a model write: `thought` as its reasoning (where the mode
        has any), then `calls` in this markup."""
        raise NotImplementedError


MARKUPS: dict[str, Markup] = {}

M = TypeVar("M", bound=Markup)


def register(markup: M) -> M:
    """Known by its `name`; every module of deltafin.markup is imported, so a new markup is one module."""
    if markup.name in MARKUPS:
        raise ValueError(f"markup {markup.name!r} is registered twice")
    MARKUPS[markup.name] = markup
    return markup
