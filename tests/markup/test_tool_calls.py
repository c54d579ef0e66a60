"""Each tool-call syntax's grammar: it accepts the family's exact wire form (and what the family's parser reads
back from it is the call), refuses text before a forced call and other names, and on each tiny model a
constrained greedy decode yields the named call the unconstrained model does not write."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from deltafin.engine.weights.loader import load_model
from deltafin.families import build_output_parser, get_family
from deltafin.grammar.compiled import logits_width
from deltafin.grammar.constraints import grammar_of, structural_tag
from deltafin.markup.glm import GLM45, GLM47
from deltafin.markup.hermes import HERMES
from deltafin.markup.kimi_k2 import KIMI_K2
from deltafin.markup.selection import forced_calls
from deltafin.markup.xtml import XTML
from deltafin.prompt import build_chat_format
from deltafin.protocol.chat import ChatMessage, ToolDefinition
from tests.conftest import tiny_config
from tests.grammar.decoding import greedy, row_factory
from tests.grammar.tools import NAMED, TIME, WEATHER

#: family -> (structure builder taking (forced, reasoning), the call in the family's wire form)
SYNTAXES = {
    "kimi_k3": (
        XTML.calls,
        '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
        '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
        '<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|>'
        "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>",
    ),
    "kimi_k2": (
        KIMI_K2.calls,
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"city": "Paris", "days": 3}<|tool_call_end|><|tool_calls_section_end|>',
    ),
    "glm45": (
        GLM45.calls,
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
    ),
    "glm47": (
        GLM47.calls,
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
        "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>",
    ),
    "qwen3": (
        HERMES.calls,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
    ),
}
#: what closes the channel the prompt opened (K3 opens a channel; think-style prompts need nothing)
CLOSE_OPEN_CHANNEL = {"kimi_k3": "<|close|>response<|sep|>"}
#: K3 writes an empty response channel between its reasoning and its calls (as its encoder renders history)
END_OF_THINKING = {"kimi_k3": "<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|>"}


def matcher(family: str, structure: dict, tokenizer) -> xgr.GrammarMatcher:
    info = xgr.TokenizerInfo.from_huggingface(tokenizer)
    return xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(grammar_of(structural_tag(structure))))


def parse(family: str, text: str, prompt_text: str, tools: list) -> dict:
    """What the family's own output parser (as serving builds it) reads from `text`."""
    model = tiny_config(family, "unused").model
    parser = build_output_parser(model.family, model.variant, prompt_text=prompt_text, tool_schemas=tools)
    deltas = [parser.feed(text), parser.finish("stop")]
    calls: dict[int, dict] = {}
    for delta in deltas:
        for call in delta.tool_calls:
            entry = calls.setdefault(call.index, {"name": call.name, "arguments": ""})
            entry["arguments"] += call.arguments
    return {"content": "".join(d.content for d in deltas), "calls": [calls[i] for i in sorted(calls)]}


@pytest.fixture(scope="module")
def tokenizers(tiny_models):
    from transformers import AutoTokenizer

    return {family: AutoTokenizer.from_pretrained(path) for family, path in tiny_models.items()}


def tools_for_parser(tools):
    import msgspec

    return [msgspec.convert(t, ToolDefinition) for t in tools]


@pytest.mark.parametrize("family", list(SYNTAXES))
class TestWireForm:
    def test_accepts_the_native_call_and_the_parser_reads_it_back(self, family, tokenizers):
        build, wire = SYNTAXES[family]
        text = CLOSE_OPEN_CHANNEL.get(family, "") + wire
        m = matcher(family, build(forced_calls([WEATHER, TIME], NAMED), "disabled"), tokenizers[family])
        assert m.accept_string(text) and m.is_completed()
        prompt = "<|open|>response<|sep|>" if family == "kimi_k3" else ""
        parsed = parse(family, text, prompt, tools_for_parser([WEATHER, TIME]))
        assert [(c["name"], json.loads(c["arguments"])) for c in parsed["calls"]] == [
            ("get_weather", {"city": "Paris", "days": 3})
        ]

    def test_no_text_before_a_forced_call(self, family, tokenizers):
        build, wire = SYNTAXES[family]
        m = matcher(family, build(forced_calls([WEATHER], "required"), "disabled"), tokenizers[family])
        assert not m.accept_string("Sure! " + CLOSE_OPEN_CHANNEL.get(family, "") + wire)

    def test_a_named_choice_refuses_the_other_tool(self, family, tokenizers):
        build, wire = SYNTAXES[family]
        other = wire.replace("get_weather", "get_time")
        m = matcher(family, build(forced_calls([WEATHER, TIME], NAMED), "disabled"), tokenizers[family])
        assert not m.accept_string(CLOSE_OPEN_CHANNEL.get(family, "") + other)

    def test_arguments_follow_the_schema(self, family, tokenizers):
        build, wire = SYNTAXES[family]
        m = matcher(family, build(forced_calls([WEATHER], NAMED), "disabled"), tokenizers[family])
        assert not m.accept_string(CLOSE_OPEN_CHANNEL.get(family, "") + wire.replace("Paris", "Oslo"))

    def test_reasoning_first_when_the_prompt_opened_it(self, family, tokenizers):
        build, wire = SYNTAXES[family]
        text = (
            "Let me think: weather.\n"
            + END_OF_THINKING.get(family, "</think>")
            + ("" if family == "kimi_k3" else "\n")
            + wire
        )
        m = matcher(family, build(forced_calls([WEATHER], NAMED), "enabled"), tokenizers[family])
        assert m.accept_string(text) and m.is_completed()
        prompt = "<|open|>think<|sep|>" if family == "kimi_k3" else "<think>"
        parsed = parse(family, text, prompt, tools_for_parser([WEATHER]))
        assert [c["name"] for c in parsed["calls"]] == ["get_weather"]

    def test_the_family_markup_writes_this_wire_form(self, family):
        """The writer the registry-derived tests (tests/markup/test_markups.py) take their cases from, pinned
        to the literal wire forms above, with the prompt's channel closed and after reasoning."""
        model = tiny_config(family, "unused").model
        markup = get_family(model.family).markup(model.variant)
        call, forced, wire = (
            ("get_weather", {"city": "Paris", "days": 3}),
            forced_calls([WEATHER, TIME], NAMED),
            SYNTAXES[family][1],
        )
        assert markup.write([call], forced=forced) == CLOSE_OPEN_CHANNEL.get(family, "") + wire
        thought = "Let me think: weather.\n"
        after = END_OF_THINKING.get(family, "</think>") + ("" if family == "kimi_k3" else "\n")
        assert markup.write([call], reasoning="enabled", thought=thought, forced=forced) == thought + after + wire


@pytest.fixture(scope="module")
def tiny_loaded():
    """family -> LoadedModel, filled on first use."""
    return {}


def serve_prompt(family, tiny_models, tools, loaded):
    kwarg = tiny_config(family, tiny_models[family]).model.thinking_kwarg
    config = tiny_config(family, tiny_models[family], [f"model.chat_template_kwargs.{kwarg}=false"])
    if family not in loaded:
        loaded[family] = load_model(config.model, config.placement)
    lm = loaded[family]
    fmt = build_chat_format(
        config.model.chat_format,
        lm.tokenizer,
        content_format=config.model.content_format,
        default_kwargs=dict(config.model.chat_template_kwargs),
    )
    prompt = fmt.render([ChatMessage(role="user", content="Weather in Paris?")], tools_for_parser(tools), {})
    return lm, prompt, config.model


@pytest.mark.parametrize("family", list(SYNTAXES))
def test_constrained_tiny_model_writes_the_named_call(family, tiny_models, tiny_loaded):
    tools = [WEATHER, TIME]
    lm, prompt, model = serve_prompt(family, tiny_models, tools, tiny_loaded)
    spec = get_family(model.family)
    # The family's grammar hook, as serving calls it.
    structure = spec.tool_call_structure(spec.variant(model.variant), tools, NAMED, prompt_text=prompt.text)
    factory = row_factory(lm.tokenizer, logits_width(lm.model), lm.stop_token_ids)
    row = factory(structural_tag(structure))
    ids = greedy(lm.model, prompt.token_ids, row, max_tokens=400, stop_ids=lm.stop_token_ids)
    text = lm.tokenizer.decode([i for i in ids if i not in lm.stop_token_ids])
    parsed = parse(family, text, prompt.text, tools_for_parser(tools))
    assert [c["name"] for c in parsed["calls"]] == ["get_weather"], text
    args = json.loads(parsed["calls"][0]["arguments"])
    assert args["city"] in ("Paris", "Rome") and 1 <= args["days"] <= 7
    # The same model, unconstrained, writes no call at all: the grammar is what made it call.
    free = lm.tokenizer.decode(greedy(lm.model, prompt.token_ids, None, max_tokens=40, stop_ids=lm.stop_token_ids))
    assert parse(family, free, prompt.text, tools_for_parser(tools))["calls"] == []


class TestHermesReasoningAndSeveralCalls:
    WIRE = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'

    def test_reasoning_block_then_call_and_no_other_name(self, tokenizers):
        structure = HERMES.calls(forced_calls([WEATHER, TIME], NAMED), "auto")
        m = matcher("glm47", structure, tokenizers["glm47"])
        assert m.accept_string("<think>\nhmm\n</think>\n\n" + self.WIRE) and m.is_completed()
        m = matcher("glm47", structure, tokenizers["glm47"])
        assert not m.accept_string(self.WIRE.replace("get_weather", "get_time"))

    def test_required_allows_several_calls(self, tokenizers):
        m = matcher("glm47", HERMES.calls(forced_calls([WEATHER, TIME], "required"), "disabled"), tokenizers["glm47"])
        second = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
        assert m.accept_string(self.WIRE + "\n" + second) and m.is_completed()
