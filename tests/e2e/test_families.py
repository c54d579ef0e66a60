"""Every family end to end: a tiny model taught a scripted tool call, served by `python -m deltafin` (an entry
`taught-FAMILY` of the shared local server, tests/shared_server.py), driven by the openai client through the real
engine, detokenizer, parser and SSE, then a follow-up turn."""

import json
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from deltafin.prompt import build_chat_format
from deltafin.protocol.chat import ChatMessage, FunctionCall, FunctionDefinition, ToolCall, ToolDefinition
from deltafin.tiny import write_tiny_model
from deltafin.tiny.taught import taught
from tests.conftest import TINY_FAMILIES, TINY_OVERRIDES, TINY_SPECS, tiny_config
from tests.shared_server import shared_model

pytestmark = pytest.mark.e2e

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
        },
    }
]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
ARGUMENTS = {"city": "Paris", "days": 3}
KIMI_ID = "functions.get_weather:0"

K3_CALL = (
    '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
    '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
    '<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|><|close|>call<|sep|>'
    "<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
)
#: family -> (turn 1: raw output with the tool call, turn 2: raw output after the tool result)
SCRIPTS = {
    # K3 writes an empty response channel beside its calls, as its encoder renders such turns.
    "kimi_k3": (
        "Weather needed.<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|>" + K3_CALL,
        "Fine.<|close|>think<|sep|><|open|>response<|sep|>Sunny in Paris.<|close|>response<|sep|>"
        "<|close|>message<|sep|><|end_of_msg|>",
    ),
    "kimi_k2": (
        "Weather needed.</think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris", "days": 3}<|tool_call_end|><|tool_calls_section_end|><|im_end|>',
        "Fine.</think>Sunny in Paris.<|im_end|>",
    ),
    "glm45": (
        "<think>Weather needed.</think><tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call><|observation|>",
        "<think>Fine.</think>Sunny in Paris.<|endoftext|>",
    ),
    "glm47": (
        "Weather needed.</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
        "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call><|observation|>",
        "Fine.</think>Sunny in Paris.<|endoftext|>",
    ),
    "qwen3": (
        '<think>Weather needed.</think><tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
        "\n</tool_call><|im_end|>",
        "<think>Fine.</think>Sunny in Paris.<|im_end|>",
    ),
}


def follow_up(call_id: str, arguments: str) -> list[dict]:
    return QUESTION + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "sunny, 21 C"},
    ]


def render(family, path, messages):
    config = tiny_config(family, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    fmt = build_chat_format(
        config.model.chat_format,
        tokenizer,
        content_format=config.model.content_format,
        default_kwargs=dict(config.model.chat_template_kwargs),
    )
    tools = [ToolDefinition(function=FunctionDefinition(**TOOLS[0]["function"]))]
    typed = []
    for m in messages:
        calls = [ToolCall(id=c["id"], function=FunctionCall(**c["function"])) for c in m.get("tool_calls") or []]
        typed.append(
            ChatMessage(
                role=m["role"], content=m.get("content"), tool_call_id=m.get("tool_call_id"), tool_calls=calls or None
            )
        )
    return fmt.render(typed, tools, {}).token_ids


def taught_model(family: str, root: Path) -> Path:
    """The family's tiny model taught SCRIPTS[family] (both turns; cached by `taught`, so tests/gateway's GLM-4.7
    upstream, taught the same examples, is this model)."""
    name, variant = TINY_SPECS[family]
    path = write_tiny_model(name, root / "model", variant=variant)
    turn1, turn2 = SCRIPTS[family]
    call_id = KIMI_ID if family.startswith("kimi") else "call_any"  # GLM and Qwen3 prompts do not carry the id
    return taught(
        path,
        [
            (render(family, path, QUESTION), turn1),
            (render(family, path, follow_up(call_id, json.dumps(ARGUMENTS))), turn2),
        ],
    )


def taught_entry(family: str):
    def prepare(root: Path) -> tuple[Path, list[str]]:
        path = taught_model(family, root)
        return path, [*TINY_OVERRIDES[family], f"model.path={path}"]

    return prepare


#: family -> its taught model, an entry of the shared local server (served as `taught-FAMILY`)
TAUGHT = {family: shared_model(f"taught-{family}", taught_entry(family)) for family in TINY_FAMILIES}


@pytest.fixture(scope="module", params=TINY_FAMILIES)
def family_server(request, local_server):
    """(family, the shared server, the name its taught model is served as)."""
    family = request.param
    return family, local_server, TAUGHT[family].name


def client_for(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120)


class TestScriptedToolCall:
    def test_tool_call_then_follow_up(self, family_server):
        family, server, model = family_server
        client = client_for(server)
        first = client.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS, temperature=0)
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.reasoning_content == "Weather needed."
        assert not choice.message.content
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == ARGUMENTS
        if family.startswith("kimi"):
            assert call.id == KIMI_ID
        second = client.chat.completions.create(
            model=model, messages=follow_up(call.id, call.function.arguments), tools=TOOLS, temperature=0
        )
        assert second.choices[0].message.content == "Sunny in Paris."
        assert second.choices[0].message.reasoning_content == "Fine."
        assert second.choices[0].finish_reason == "stop"

    def test_streamed_tool_call_deltas(self, family_server):
        family, server, model = family_server
        stream = client_for(server).chat.completions.create(
            model=model,
            messages=QUESTION,
            tools=TOOLS,
            temperature=0,
            seed=1,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert deltas[0].role == "assistant"
        reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        assert reasoning == "Weather needed."
        call_deltas = [tc for d in deltas for tc in (d.tool_calls or [])]
        head, *rest = call_deltas
        assert (head.index, head.type, head.function.name, head.function.arguments) == (
            0,
            "function",
            "get_weather",
            "",
        )
        assert head.id
        assert all(tc.index == 0 and tc.id is None for tc in rest)
        assert len(rest) > 1, "arguments should stream in fragments as the model writes them"
        assert json.loads("".join(tc.function.arguments for tc in rest)) == ARGUMENTS
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finish == ["tool_calls"]
        assert chunks[-1].usage.completion_tokens > 0

    def test_plain_chat_without_tools(self, family_server):
        _, server, model = family_server
        response = client_for(server).chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=5
        )
        assert response.choices[0].finish_reason in ("stop", "length")

    def test_parse_endpoint_reads_the_raw_script(self, family_server):
        family, server, model = family_server
        body = httpx.post(
            f"{server.base_url}/parse", json={"model": model, "text": SCRIPTS[family][0], "tools": TOOLS}
        ).json()
        call = body["message"]["tool_calls"][0]
        assert body["finish_reason"] == "tool_calls" and body["message"]["reasoning_content"] == "Weather needed."
        assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == ARGUMENTS


def client_model(server) -> str:
    """The id of a server's only model (a standalone server or gateway; the shared server lists several)."""
    return httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["id"]
