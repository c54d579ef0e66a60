"""A function-call round trip through /v1/responses on a tiny family with a tool parser (Qwen3, Hermes calls),
taught a script, served by `python -m deltafin` (as `agents-qwen3`, an entry of the shared local server,
tests/shared_server.py): first with the openai client (the call, then its output sent back with
previous_response_id), then with openai-agents' default model (OpenAIResponsesModel) running a real function tool.

The prompts the model is taught are the ones the server will render: the agent's request bodies are recorded
from the agent itself (against a scripted stand-in), and every body goes through Deltafin's own conversion and
the model's chat format here, in the test."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import openai
import pytest
from transformers import AutoTokenizer

from deltafin.prompt import build_chat_format
from deltafin.protocol.responses import ResponsesRequest
from deltafin.serving.responses.conversation import speaks_developer
from deltafin.serving.responses.items import canonical_input
from deltafin.serving.responses.service import chat_request
from deltafin.serving.responses.tools import served_tools
from deltafin.tiny import write_tiny_model
from deltafin.tiny.taught import taught
from tests.conftest import TINY_OVERRIDES, tiny_config
from tests.e2e.stand_in import stand_in
from tests.shared_server import shared_model

pytestmark = pytest.mark.e2e

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
QUESTION = "What is the weather in Paris?"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
ANSWER = "Sunny in Paris.<|im_end|>"
THINKING_OFF = ["model.chat_template_kwargs.enable_thinking=false"]


def client_bodies() -> list[dict]:
    """What the openai-client test sends, as the server sees it (turn 2 with the stored turn 1 as its context)."""
    call = {"type": "function_call", "call_id": "call_any", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    return [
        {"input": QUESTION, "tools": [WEATHER]},
        {
            "input": [
                {"role": "user", "content": QUESTION},
                call,
                {"type": "function_call_output", "call_id": "call_any", "output": "sunny, 21 C"},
            ],
            "tools": [WEATHER],
        },
    ]


def recorded_agent_bodies() -> list[dict]:
    """The agent's two request bodies, recorded against a stand-in that answers with the script."""
    outputs = [
        [
            {
                "type": "function_call",
                "id": "fc_1",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city": "Paris"}',
                "status": "completed",
            }
        ],
        [
            {
                "type": "message",
                "id": "msg_1",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Sunny in Paris.", "annotations": []}],
            }
        ],
    ]

    def reply(bodies: list[dict]) -> tuple[int, dict]:
        return 200, {
            "id": f"resp_{len(bodies)}",
            "object": "response",
            "created_at": 0,
            "model": "m",
            "status": "completed",
            "output": outputs[len(bodies) - 1],
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "usage": {
                "input_tokens": 1,
                "output_tokens": 1,
                "total_tokens": 2,
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0},
            },
        }

    with stand_in(reply) as (base_url, bodies):
        result, _ = run_agent(base_url, AGENTS.name)
    assert result == "Sunny in Paris." and len(bodies) == 2
    return bodies


def run_agent(base_url: str, served: str) -> tuple[str, list[str]]:
    from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Weather for a city."""
        asked.append(city)
        return f"sunny, 21 C in {city}"

    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    model = OpenAIResponsesModel(model=served, openai_client=client)
    agent = Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather], model=model)
    return Runner.run_sync(agent, QUESTION, max_turns=4).final_output, asked


def prompt_ids(fmt, template: str, config, body: dict) -> list[int]:
    request = msgspec.json.decode(json.dumps(body).encode(), type=ResponsesRequest)
    tools = served_tools(request.tools, unsupported="drop")
    chat = chat_request(
        request,
        tools,
        canonical_input(request.input),
        model_name="qwen3",
        developer_role=speaks_developer("template", template),
        thinking_kwarg=config.model.thinking_kwarg,
    )
    return fmt.render(chat.messages, chat.tools, dict(chat.chat_template_kwargs or {})).token_ids


def prepare(root: Path) -> tuple[Path, list[str]]:
    path = write_tiny_model("qwen3", root / "model")
    config = tiny_config("qwen3", path, THINKING_OFF)
    tokenizer = AutoTokenizer.from_pretrained(path)
    fmt = build_chat_format(
        config.model.chat_format,
        tokenizer,
        content_format=config.model.content_format,
        default_kwargs=dict(config.model.chat_template_kwargs),
    )
    turns = [client_bodies(), recorded_agent_bodies()]
    # Four prompts sharing long prefixes: trained until the loss is negligible (teach stops early once it is).
    examples = [
        (prompt_ids(fmt, tokenizer.chat_template, config, body), reply)
        for bodies in turns
        for body, reply in zip(bodies, (CALL, ANSWER))
    ]
    path = taught(path, examples, steps=800)
    return path, [*TINY_OVERRIDES["qwen3"], f"model.path={path}", *THINKING_OFF]


#: the taught model, an entry of the shared local server (requests name it)
AGENTS = shared_model("agents-qwen3", prepare)


@pytest.fixture(scope="module")
def server(local_server):
    return local_server


def test_function_call_round_trip_with_the_openai_client(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    first = client.responses.create(model=AGENTS.name, input=QUESTION, tools=[WEATHER], temperature=0)
    [call] = first.output
    assert (
        call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    )
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    second = client.responses.create(
        model=AGENTS.name, previous_response_id=first.id, tools=[WEATHER], temperature=0, input=[output]
    )
    assert second.output_text == "Sunny in Paris." and second.status == "completed"
    items = client.responses.input_items.list(second.id, order="asc")
    assert [item.type for item in items.data] == ["function_call_output"]
    with client.responses.stream(model=AGENTS.name, input=QUESTION, tools=[WEATHER], temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(arguments) == {"city": "Paris"} and final.output[0].arguments == arguments


def test_openai_agents_default_model_runs_a_function_tool(server):
    answer, asked = run_agent(f"{server.base_url}/v1", AGENTS.name)
    assert asked == ["Paris"] and answer == "Sunny in Paris."
