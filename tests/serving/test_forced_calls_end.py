"""A forced tool call ends: on every tiny family, through the HTTP app in process with the real engine and its
compiled grammar, a call forced with parallel calls off is one call, its JSON whitespace bounded as llama.cpp's
grammar bounds it, and the turn ends right after it (finish_reason "tool_calls", never "length"); with parallel
calls on, more calls may follow, nothing else.

The tiny models have random weights, which is the point: a model that does not know when to stop is what the
grammar must stop. The case that found it: the tiny Kimi K2 through /v1/responses (tool_choice required,
parallel_tool_calls false, an enum argument, reasoning off) wrote `{"city":` then ten `\\r\\n` before its value.
"""

from __future__ import annotations

import json
import re

import pytest
from litestar.testing import TestClient

from deltafin.app import build_app
from deltafin.app.services import Services
from tests.conftest import TINY_FAMILIES, tiny_config

CITY = {"type": "string", "enum": ["Paris", "London", "Oslo"]}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": CITY, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["city", "days"],
    },
}
TIME = {
    "type": "function",
    "name": "get_time",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}},
}


def within_llama_whitespace(arguments: str) -> bool:
    """Every run of whitespace is one llama.cpp's JSON grammar allows between two tokens: one space, or one or two
    newlines and at most 20 spaces or tabs (common/json-schema-to-grammar.cpp, SPACE_RULE). The argument values
    here are enum strings and integers: all whitespace in the text stands between tokens."""
    return all(re.fullmatch(r" |\n{1,2}[ \t]{0,20}", run) for run in re.findall(r"[ \t\r\n]+", arguments))


def chat_tools(*tools: dict) -> list[dict]:
    return [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in tools]


@pytest.fixture(scope="module", params=TINY_FAMILIES)
def family(request, tiny_models):
    """(name, client, thinking off): reasoning stays off here, since a random model never ends it by itself
    (the thinking budget's tests force its end before a forced call: tests/serving/test_thinking_budget.py)."""
    name = request.param
    config = tiny_config(name, tiny_models[name])
    with TestClient(build_app(config, Services.load(config))) as client:
        yield name, client, {"chat_template_kwargs": {config.model.thinking_kwarg: False}}


def test_the_tiny_kimi_k2s_forced_call_through_responses_ends(tiny_models):
    """The reported case, as sent: greedy, so the model's own preference for whitespace shows."""
    config = tiny_config("kimi_k2", tiny_models["kimi_k2"])
    with TestClient(build_app(config, Services.load(config))) as client:
        body = {
            "input": "What is the weather in Paris?",
            "tools": [
                {**WEATHER, "parameters": {"type": "object", "properties": {"city": CITY}, "required": ["city"]}}
            ],
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "reasoning": {"effort": "none"},
            "temperature": 0,
            "max_output_tokens": 400,
        }
        response = client.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["status"] == "completed", answer.get("incomplete_details")
    (call,) = answer["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert json.loads(call["arguments"])["city"] in CITY["enum"]
    assert within_llama_whitespace(call["arguments"]), call["arguments"]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_one_forced_call_ends_the_turn(family, seed):
    name, client, thinking_off = family
    body = {
        **thinking_off,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": chat_tools(WEATHER, TIME),
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 1.0,
        "seed": seed,
        "max_tokens": 600,
    }
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", (name, choice)
    (call,) = choice["message"]["tool_calls"]
    arguments = json.loads(call["function"]["arguments"])
    if call["function"]["name"] == "get_weather":
        assert arguments["city"] in CITY["enum"] and 1 <= arguments["days"] <= 9
    else:
        assert call["function"]["name"] == "get_time" and set(arguments) <= {"zone"}
    assert within_llama_whitespace(call["function"]["arguments"]), call["function"]["arguments"]
    assert not (choice["message"]["content"] or "").strip(), "nothing but the call"


def test_parallel_calls_are_calls_and_nothing_else(family):
    name, client, thinking_off = family
    body = {
        **thinking_off,
        "messages": [{"role": "user", "content": "Weather and time, please."}],
        "tools": chat_tools(WEATHER, TIME),
        "tool_choice": "required",
        "temperature": 1.0,
        "seed": 7,
        "max_tokens": 1500,
    }
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", (name, choice)
    calls = choice["message"]["tool_calls"]
    assert calls and all(c["function"]["name"] in ("get_weather", "get_time") for c in calls)
    for call in calls:
        assert within_llama_whitespace(call["function"]["arguments"]), call["function"]["arguments"]
    assert not (choice["message"]["content"] or "").strip()
