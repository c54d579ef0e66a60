"""Feeding literal model output to a family's parser: whole, and split at every chunk boundary."""

import json

from deltafin.families import build_output_parser
from tests.conftest import TINY_SPECS

#: the parser dialects under test (the tiny models' names) -> (model.family, model.variant)
DIALECTS = TINY_SPECS

WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "units": {"type": ["string", "null"]},
                    "opts": {"type": "object"},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]

K3_THINK = '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
K3_RESPONSE = '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'
K3_MESSAGE = '<|open|>message role="assistant"<|sep|>'  # no channel open: the model opens one itself


def tool(name, **properties):
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": properties}}}


def ids(index, name):
    return f"call_{index}"


def make(fmt, prompt_text, tools=WEATHER, calls_allowed=None):
    family, variant = DIALECTS[fmt]
    return build_output_parser(
        family, variant, prompt_text=prompt_text, tool_schemas=tools, calls_allowed=calls_allowed, new_id=ids
    )


def collect(parser, pieces, finish="stop"):
    result = {"content": "", "reasoning": "", "calls": {}}
    for delta in [parser.feed(p) for p in pieces] + [parser.finish(finish)]:
        result["content"] += delta.content
        result["reasoning"] += delta.reasoning
        for call in delta.tool_calls:
            entry = result["calls"].setdefault(call.index, {"id": call.id, "name": call.name, "arguments": ""})
            entry["arguments"] += call.arguments
    result["calls"] = [result["calls"][i] for i in sorted(result["calls"])]
    return result


def parse_whole(fmt, prompt, text, finish="stop", **options):
    return collect(make(fmt, prompt, **options), [text], finish)


def assert_every_split_matches(fmt, prompt, text, finish="stop", **options):
    """The whole text parsed at once; the same at every two-piece split and one character at a time."""
    whole = parse_whole(fmt, prompt, text, finish, **options)
    for cut in range(1, len(text)):
        assert collect(make(fmt, prompt, **options), [text[:cut], text[cut:]], finish) == whole, f"split at {cut}"
    assert collect(make(fmt, prompt, **options), list(text), finish) == whole, "one character at a time"
    return whole


def calls_of(result):
    """[(name, arguments)] with arguments decoded when they are JSON (else the raw string)."""
    out = []
    for call in result["calls"]:
        try:
            arguments = json.loads(call["arguments"])
        except ValueError:
            arguments = call["arguments"]
        out.append((call["name"], arguments))
    return out
