"""Every family with a tiny model, derived from the registry (tests.conftest.TINY_SPECS): its own chat format,
thinking on and off, leaves the output where its markup reads it; there the family's grammar hook (as serving
calls it) accepts the forced call as its markup writes it, and the family's parser (as serving builds it)
reads back that call and the reasoning. A new family with an existing markup is tested by this file unchanged."""

from __future__ import annotations

import json

import msgspec
import pytest
from transformers import AutoTokenizer

from deltafin.families import FAMILIES, build_output_parser, get_family
from deltafin.markup import MARKUPS
from deltafin.markup.selection import forced_calls
from deltafin.prompt import build_chat_format
from deltafin.protocol.chat import ChatMessage, ToolDefinition
from tests.conftest import TINY_FAMILIES, tiny_config
from tests.grammar.gbnf_oracle import tag_recognizer
from tests.grammar.tools import NAMED, TIME, WEATHER
from tests.markup.parsing import collect

CALL = ("get_weather", {"city": "Rome", "days": 2})
THOUGHT = "Weather needed."


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_family_markup_is_a_registered_one(name):
    family = FAMILIES[name]
    for variant in family.variants or (None,):
        markup = family.markup(variant)
        assert markup is None or MARKUPS[markup.name] is markup


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("tiny", TINY_FAMILIES)
def test_the_prompt_leaves_output_where_the_markup_reads_a_forced_call(tiny, thinking, tiny_models):
    kwarg = tiny_config(tiny, tiny_models[tiny]).model.thinking_kwarg
    model = tiny_config(tiny, tiny_models[tiny], [f"model.chat_template_kwargs.{kwarg}={str(thinking).lower()}"]).model
    fmt = build_chat_format(
        model.chat_format,
        AutoTokenizer.from_pretrained(tiny_models[tiny]),
        content_format=model.content_format,
        default_kwargs=dict(model.chat_template_kwargs),
    )
    tools = [msgspec.convert(t, ToolDefinition) for t in (WEATHER, TIME)]
    prompt = fmt.render([ChatMessage(role="user", content="Weather in Rome?")], tools, {}).text

    family = get_family(model.family)
    variant = family.variant(model.variant)
    markup = family.markup(variant)
    mode = markup.reasoning(prompt)
    assert mode in markup.prompt_endings and (mode == "disabled") == (not thinking)
    text = markup.write([CALL], reasoning=mode, thought=THOUGHT if thinking else "", forced=forced_calls(tools, NAMED))

    structure = family.tool_call_structure(variant, tools, NAMED, prompt_text=prompt)
    assert tag_recognizer(structure)(text)
    parsed = collect(build_output_parser(model.family, variant, prompt_text=prompt, tool_schemas=tools), [text])
    assert [(c["name"], json.loads(c["arguments"])) for c in parsed["calls"]] == [CALL]
    assert (parsed["reasoning"], parsed["content"]) == (THOUGHT if thinking else "", "")
