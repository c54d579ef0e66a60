"""Through the real server (an entry of the shared local server: the tiny Kimi K2, random weights) and the official
clients: openai-agents runs the tool a forced call names, and the openai client's thinking budget holds on chat
(plain and streamed), completions and responses.

The forced call as reported: tool_choice required, parallel calls off, an enum argument, reasoning off. A model
that knows nothing makes its call by the grammar alone; the response must end after it (completed, not
incomplete), with JSON whitespace as llama.cpp's grammar allows, and the agent must run its tool.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

import openai
import pytest

from deltafin.tiny import write_tiny_model
from tests.conftest import TINY_OVERRIDES
from tests.shared_server import shared_model

pytestmark = pytest.mark.e2e

QUESTION = "What is the weather in Paris?"


def _kimi_k2(root: Path) -> tuple[Path, list[str]]:
    path = write_tiny_model("kimi_k2", root / "model")
    return path, [*TINY_OVERRIDES["kimi_k2"], f"model.path={path}", "server.memo.entries=0"]


K2 = shared_model("random-kimi-k2", _kimi_k2)


def llama_whitespace(arguments: str) -> bool:
    """Each whitespace run is one space, or one or two newlines and at most 20 spaces or tabs (the argument values
    here are enum strings: all whitespace stands between JSON tokens)."""
    return all(re.fullmatch(r" |\n{1,2}[ \t]{0,20}", run) for run in re.findall(r"[ \t\r\n]+", arguments))


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_openai_agents_runs_the_tool_a_forced_call_names(local_server):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from openai.types.shared import Reasoning

    set_tracing_disabled(True)
    asked: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "London"]) -> str:
        """Weather for a city."""
        asked.append(city)
        return f"sunny in {city}"

    model = OpenAIResponsesModel(
        model=K2.name,
        openai_client=openai.AsyncOpenAI(
            base_url=f"{local_server.base_url}/v1", api_key="unused", max_retries=0, timeout=300
        ),
    )
    agent = Agent(
        name="weather",
        instructions="Answer with the weather tool.",
        tools=[get_weather],
        model=model,
        model_settings=ModelSettings(
            tool_choice="required", parallel_tool_calls=False, reasoning=Reasoning(effort="none"), temperature=0
        ),
        tool_use_behavior="stop_on_first_tool",
    )
    result = Runner.run_sync(agent, QUESTION, max_turns=2)
    [response] = result.raw_responses
    [call] = response.output
    assert call.type == "function_call" and call.status == "completed"
    assert len(asked) == 1 and result.final_output == f"sunny in {asked[0]}"
    assert llama_whitespace(call.arguments), call.arguments


def test_the_openai_clients_thinking_budget_holds_on_every_api(local_server):
    """`thinking_token_budget` as an extra body field (the SDK has no parameter for it); usage says how many
    reasoning tokens there were, and a random model reasons on until the budget ends it."""
    api = client(local_server)
    budget = {"thinking_token_budget": 3}
    chat = api.chat.completions.create(
        model=K2.name, messages=[{"role": "user", "content": QUESTION}], max_tokens=30, seed=1, extra_body=budget
    )
    assert chat.usage.completion_tokens_details.reasoning_tokens == 3
    stream = api.chat.completions.create(
        model=K2.name,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=30,
        seed=1,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=budget,
    )
    chunks = list(stream)
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    assert reasoning == chat.choices[0].message.reasoning_content
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 3
    prompt = "<|im_user|>user<|im_middle|>Hi<|im_end|><|im_assistant|>assistant<|im_middle|><think>"
    completion = api.completions.create(model=K2.name, prompt=prompt, max_tokens=20, seed=1, extra_body=budget)
    assert completion.usage.completion_tokens_details.reasoning_tokens == 3
    assert "</think>" in completion.choices[0].text
    response = api.responses.create(
        model=K2.name, input=QUESTION, max_output_tokens=30, extra_body={"reasoning": {"max_tokens": 3}}
    )
    assert response.usage.output_tokens_details.reasoning_tokens == 3 and response.output[0].type == "reasoning"
