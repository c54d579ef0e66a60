"""Every registered markup, derived from the registry (deltafin.markup.MARKUPS): a new markup gets these tests.

For each markup, each reasoning mode it reads off a prompt and each way a call is forced, the output its
writer produces for the forced calls
- is what its structural tag accepts (xgrammar), while text before the calls, a tool that was not offered,
  arguments outside the schema and text after the calls are refused;
- is accepted by its llama-server GBNF exactly where xgrammar accepts it, markers as text and as token ids;
- is read back by its own parser as those calls (and the reasoning), whole, at every chunk boundary and one
  character at a time.
The writer itself is pinned to literal wire forms in tests/markup/test_tool_calls.py.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from deltafin.grammar.gbnf import structural_tag_to_gbnf
from deltafin.markup import MARKUPS
from deltafin.markup.forced_json import FORCED_JSON, forced_call_schema
from deltafin.markup.selection import forced_calls
from tests.grammar.gbnf_oracle import gbnf_recognizer, schema_recognizer, tag_recognizer
from tests.grammar.tools import NAMED, TIME, WEATHER
from tests.markup.parsing import collect

NOW = {"type": "function", "function": {"name": "now"}}  # no parameters: any arguments object
#: how a call is forced -> (tools, tool_choice, parallel_tool_calls, the calls written)
FORCES = {
    "named": ([WEATHER, TIME], NAMED, None, [("get_weather", {"city": "Paris", "days": 3})]),
    "named-only-tool": ([WEATHER], NAMED, None, [("get_weather", {"city": "Rome", "days": 7})]),
    "required-two": (
        [WEATHER, TIME],
        "required",
        None,
        [("get_weather", {"city": "Rome", "days": 1}), ("get_time", {"zone": "CET"})],
    ),
    "required-one": ([WEATHER, TIME], "required", False, [("get_time", {"zone": "UTC"})]),
    "no-arguments": ([NOW], "required", None, [("now", {})]),
}
THOUGHT = "plan: call it"
CASES = [
    (name, mode, force)
    for name, markup in sorted(MARKUPS.items())
    for mode in markup.prompt_endings
    for force in FORCES
]


def forced_of(force: str):
    tools, choice, parallel, _ = FORCES[force]
    return forced_calls(tools, choice, parallel_tool_calls=parallel)


def written(name: str, mode: str, force: str, calls=None) -> str:
    markup = MARKUPS[name]
    return markup.write(
        FORCES[force][3] if calls is None else calls,
        reasoning=mode,
        thought=THOUGHT if mode != "disabled" else "",
        forced=forced_of(force),
    )


def refused_variants(name: str, mode: str, force: str) -> list[str]:
    """Outputs the forced grammar must refuse (each differs from the right one)."""
    calls = FORCES[force][3]
    right = written(name, mode, force)
    wrong = [right + " thanks", written(name, mode, force, [("get_date", args) for _, args in calls])]
    if calls[0][0] == "get_weather":
        wrong.append(written(name, mode, force, [("get_weather", {"city": "Oslo", "days": 3}), *calls[1:]]))
        wrong.append(written(name, mode, force, [("get_weather", {"city": "Paris", "days": 12}), *calls[1:]]))
    if mode == "disabled":
        wrong.append("Sure! " + right)
    return [text for text in wrong if text != right]


def special_tokens(name: str) -> dict[str, int]:
    """The markup's markers as made-up token ids (only the text matters to the grammar)."""
    return {text: 1000 + i for i, text in enumerate(MARKUPS[name].markers)}


@pytest.mark.parametrize("name", sorted(MARKUPS))
def test_the_reasoning_mode_is_read_off_the_prompt(name):
    markup = MARKUPS[name]
    for mode, ending in markup.prompt_endings.items():
        assert markup.reasoning("<|rendered prompt|>" + ending) == mode


@pytest.mark.parametrize(("name", "mode", "force"), CASES)
def test_the_grammar_accepts_what_the_markup_writes_and_nothing_else(name, mode, force):
    tag = MARKUPS[name].calls(forced_of(force), mode)
    accepts = tag_recognizer(tag)
    assert accepts(written(name, mode, force))
    assert [text for text in refused_variants(name, mode, force) if accepts(text)] == []


@pytest.mark.parametrize("with_token_ids", [False, True])
@pytest.mark.parametrize(("name", "mode", "force"), CASES)
def test_gbnf_accepts_exactly_what_xgrammar_accepts(name, mode, force, with_token_ids):
    tag = MARKUPS[name].calls(forced_of(force), mode)
    specials = special_tokens(name) if with_token_ids else None
    mine, reference = gbnf_recognizer(structural_tag_to_gbnf(tag, specials), specials), tag_recognizer(tag)
    for text in [written(name, mode, force), *refused_variants(name, mode, force)]:
        assert mine(text) == reference(text), text


@pytest.mark.parametrize(("name", "mode", "force"), CASES)
def test_the_parser_reads_back_what_the_markup_writes(name, mode, force):
    markup, text = MARKUPS[name], written(name, mode, force)
    tools = FORCES[force][0]

    def parser():
        return markup.output_parser(
            prompt_text="<|rendered prompt|>" + markup.prompt_endings[mode],
            tools=tools,
            calls_allowed=True,
            new_id=lambda i, n: f"id{i}",
            forced=forced_of(force),
        )

    whole = collect(parser(), [text])
    assert [(c["name"], json.loads(c["arguments"])) for c in whole["calls"]] == FORCES[force][3]
    assert all(c["id"] for c in whole["calls"])
    assert whole["reasoning"] == (THOUGHT if mode != "disabled" else "")
    assert whole["content"] == ""
    for cut in range(1, len(text)):
        assert collect(parser(), [text[:cut], text[cut:]]) == whole, f"split at {cut}"
    assert collect(parser(), list(text)) == whole, "one character at a time"


@pytest.mark.parametrize("force", sorted(FORCES))
def test_forced_json_calls_are_the_schema_serving_sends(force):
    """Serving sends forced_call_schema as a JSON-schema constraint; the markup's structural tag is that language."""
    forced = forced_of(force)
    as_tag, as_schema = (
        tag_recognizer(FORCED_JSON.calls(forced, "disabled")),
        schema_recognizer(forced_call_schema(forced)),
    )
    for text in [written("forced_json", "disabled", force), *refused_variants("forced_json", "disabled", force)]:
        assert as_tag(text) == as_schema(text), text


MARKUP_DIR = Path(__file__).resolve().parents[2] / "deltafin" / "markup"
MARKUP_MODULES = {type(markup).__module__ for markup in MARKUPS.values()}


def test_every_module_that_defines_a_markup_is_found():
    assert {
        f"deltafin.markup.{p.stem}" for p in MARKUP_DIR.glob("*.py") if "= register(" in p.read_text()
    } == MARKUP_MODULES


@pytest.mark.parametrize("module", sorted(p.stem for p in MARKUP_DIR.glob("*.py")))
def test_a_markup_module_imports_no_other_markup(module):
    """A markup's module stands on the shared pieces (base, parsing, chain, think, values, formats, selection,
    xml_args), never on another markup's module; the package stands on nothing above protocol."""
    tree = ast.parse((MARKUP_DIR / f"{module}.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    ours = {m for m in imported if m.startswith("deltafin.")}
    assert ours & (MARKUP_MODULES - {f"deltafin.markup.{module}"}) == set()
    assert {m for m in ours if not m.startswith("deltafin.markup")} <= {"deltafin.protocol.sampling"}


@pytest.mark.parametrize(
    "markup", [m for m in MARKUPS.values() if hasattr(m, "reasoning_excludes")], ids=lambda m: m.name
)
def test_a_forced_outputs_reasoning_holds_nothing_its_parser_reads_as_a_call(markup):
    """The reasoning parser ends reasoning at any call opener; a forced output's grammar must keep them all out
    of the reasoning block, or the parser reads a call the grammar never enforced."""
    assert set(markup.call_openers) <= set(markup.reasoning_excludes)
