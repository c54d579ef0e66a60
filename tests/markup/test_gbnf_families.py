"""Every family's enforced-call grammar as GBNF accepts exactly what xgrammar accepts for the same structural
tag, over a combinatorial set of outputs: reasoning prefixes (right and wrong), one or two calls, the other
tool's name, arguments in and out of the schema, text before the call. Both modes (named, required), one and
two tools, parallel calls on and off, reasoning enabled / disabled / auto."""

from __future__ import annotations

import itertools
import json

import pytest

from deltafin.grammar.gbnf import structural_tag_to_gbnf
from deltafin.markup.glm import GLM45, GLM47
from deltafin.markup.hermes import HERMES
from deltafin.markup.kimi_k2 import KIMI_K2
from deltafin.markup.selection import forced_calls
from deltafin.markup.xtml import XTML
from tests.grammar.gbnf_oracle import gbnf_recognizer, tag_recognizer
from tests.grammar.tools import NAMED, TIME, WEATHER

SYNTAXES = {"kimi_k3": XTML, "kimi_k2": KIMI_K2, "glm45": GLM45, "glm47": GLM47, "qwen3": HERMES}
_THINK = ["<think>", "</think>"]
#: each family's markers that are single tokens of its real vocabulary (ids made up: only the text matters here)
MARKERS = {
    "kimi_k3": ["<|open|>", "<|close|>", "<|sep|>"],
    "kimi_k2": [
        *_THINK,
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
    ],
    "glm45": [*_THINK, "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"],
    "qwen3": [*_THINK, "<tool_call>", "</tool_call>"],
}
MARKERS["glm47"] = MARKERS["glm45"]


def special_tokens(family: str) -> dict[str, int]:
    return {text: 1000 + i for i, text in enumerate(MARKERS[family])}


#: argument sets: in the schema (city enum, days 1..7), and out of it
ARGUMENTS = [
    ("get_weather", {"city": "Paris", "days": 3}),
    ("get_weather", {"city": "Rome", "days": 7}),
    ("get_weather", {"city": "Rome", "days": 0}),
    ("get_weather", {"city": "Rome", "days": 12}),
    ("get_weather", {"city": "Oslo", "days": 3}),
    ("get_weather", {"city": "Paris"}),
    ("get_weather", {"days": 3, "city": "Paris"}),
    ("get_time", {"zone": "UTC"}),
    ("get_time", {"zone": "UTC", "x": 1}),
]


def _k3_value(value) -> tuple[str, str]:
    return ("string", value) if isinstance(value, str) else ("number", json.dumps(value))


def call(family: str, name: str, args: dict, index: int) -> str:
    if family == "kimi_k3":
        body = "".join(
            f'<|open|>argument key="{k}" type="{_k3_value(v)[0]}"<|sep|>{_k3_value(v)[1]}<|close|>argument<|sep|>'
            for k, v in args.items()
        )
        return f'<|open|>call tool="{name}" index="{index}"<|sep|>{body}<|close|>call<|sep|>'
    if family == "kimi_k2":
        return f"<|tool_call_begin|>functions.{name}:{index}<|tool_call_argument_begin|>{json.dumps(args)}<|tool_call_end|>"
    if family == "qwen3":
        return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'
    nl = "\n" if family == "glm45" else ""
    pairs = "".join(f"<arg_key>{k}</arg_key>{nl}<arg_value>{v}</arg_value>{nl}" for k, v in args.items())
    return f"<tool_call>{name}{nl}{pairs}</tool_call>"


def wire(family: str, calls: list[str]) -> str:
    if family == "kimi_k3":
        return f"<|open|>tools<|sep|>{''.join(calls)}<|close|>tools<|sep|><|close|>message<|sep|>"
    if family == "kimi_k2":
        return f"<|tool_calls_section_begin|>{''.join(calls)}<|tool_calls_section_end|>"
    return {"glm47": ""}.get(family, "\n").join(calls)


PREFIXES = {
    "kimi_k3": [
        "",
        "<|close|>response<|sep|>",
        "hm<|close|>think<|sep|>",
        "<|close|>think<|sep|>",
        "hm<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|>",
        "<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|>",
        "a<|open|>b<|close|>think<|sep|>",
        "Sure! <|close|>response<|sep|>",
    ],
    "think": [
        "",
        "Sure! ",
        "hm</think>",
        "hm</think>\n\n",
        "hm</think>\n\n\n",
        "<think>hm</think>\n",
        "<think></think>",
        "a<think>b</think>",
        "<think>hm</think>\n</think>",
    ],
}


def outputs(family: str) -> list[str]:
    bodies = [wire(family, [call(family, n, a, 0)]) for n, a in ARGUMENTS]
    bodies += [
        wire(family, [call(family, "get_weather", ARGUMENTS[0][1], 0), call(family, "get_time", {"zone": "CET"}, 1)]),
        wire(family, []),
        wire(family, [call(family, "get_weather", ARGUMENTS[0][1], 0)]) + " thanks",
    ]
    prefixes = PREFIXES.get(family, PREFIXES["think"])
    return [p + b for p, b in itertools.product(prefixes, bodies)]


CASES = [
    (family, reasoning, tools, choice, parallel)
    for family in SYNTAXES
    for reasoning in ("enabled", "disabled", "auto")
    for tools, choice, parallel in [
        ([WEATHER], NAMED, None),
        ([WEATHER, TIME], NAMED, None),
        ([WEATHER, TIME], "required", None),
        ([WEATHER, TIME], "required", False),
    ]
]


@pytest.mark.parametrize("with_token_ids", [False, True])
@pytest.mark.parametrize(("family", "reasoning", "tools", "choice", "parallel"), CASES)
def test_gbnf_accepts_what_xgrammar_accepts(family, reasoning, tools, choice, parallel, with_token_ids):
    tag = SYNTAXES[family].calls(forced_calls(tools, choice, parallel_tool_calls=parallel), reasoning)
    specials = special_tokens(family) if with_token_ids else None
    grammar = structural_tag_to_gbnf(tag, specials)
    assert ("<[" in grammar) == with_token_ids
    mine, ref = gbnf_recognizer(grammar, specials), tag_recognizer(tag)
    verdicts = [(text, ref(text)) for text in outputs(family)]
    assert any(ok for _, ok in verdicts), "the sample set must hold outputs xgrammar accepts"
    assert [(text, mine(text)) for text, _ in verdicts] == verdicts


@pytest.mark.parametrize(
    ("family", "value"), [("kimi_k2", "a<|tool_call_end|>b"), ("qwen3", "a</tool_call>b"), ("kimi_k3", "a<|close|>b")]
)
def test_control_token_markers_stay_out_of_json_strings(family, value):
    """A forced call's JSON strings (keys and values) may not hold the markup's markers, which its parser ends
    the call at: not as text (the structural tag excludes them, in xgrammar and in GBNF alike), and not as the
    control token (llama.cpp's character rules would match a token by its text)."""
    any_args = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    tag = SYNTAXES[family].calls(forced_calls([any_args], "required"), "disabled")
    if family == "kimi_k3":  # strings inside a JSON-typed argument
        text = "<|close|>response<|sep|>" + wire(
            family,
            [
                call(family, "get_time", {"zone": 1}, 0)
                .replace(">1<", f">[{json.dumps(value)}]<")
                .replace('"integer"', '"array"')
            ],
        )
    else:
        text = wire(family, [call(family, "get_time", {"zone": value}, 0)])
    specials = special_tokens(family)
    assert not tag_recognizer(tag)(text)
    assert not gbnf_recognizer(structural_tag_to_gbnf(tag))(text)
    assert not gbnf_recognizer(structural_tag_to_gbnf(tag, specials), specials)(text)
    assert tag_recognizer(tag)(text.replace(value, "a b"))
    assert gbnf_recognizer(structural_tag_to_gbnf(tag, specials), specials)(text.replace(value, "a b"))
