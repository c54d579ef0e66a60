"""A Messages request renders, token for token, the prompt its chat request renders, on every family's own chat
format (tiny models' tokenizers and templates): the scripted tool round trip of tests/e2e/test_families.py
(which the taught models answer, so tests/e2e/test_messages.py gets their scripts back), and thinking blocks in
history as the turn's `reasoning_content`."""

from __future__ import annotations

import json

import msgspec
import pytest
from transformers import AutoTokenizer

from deltafin.prompt import build_chat_format
from deltafin.protocol.chat import ChatCompletionRequest
from deltafin.protocol.messages import MessagesRequest
from deltafin.serving.messages.request import chat_request
from tests.conftest import TINY_FAMILIES, tiny_config
from tests.e2e.test_families import ARGUMENTS, KIMI_ID, QUESTION, TOOLS, follow_up

#: the scripted tool, as Anthropic declares it
WEATHER = {
    "name": TOOLS[0]["function"]["name"],
    "description": TOOLS[0]["function"]["description"],
    "input_schema": TOOLS[0]["function"]["parameters"],
}


def call_id(family: str) -> str:
    return KIMI_ID if family.startswith("kimi") else "call_any"


def round_trip(family: str, thinking: str | None = None) -> list[dict]:
    """The scripted conversation in Anthropic's form: the question, the call (with its thinking block), the result."""
    blocks = [{"type": "thinking", "thinking": thinking, "signature": ""}] if thinking else []
    blocks.append({"type": "tool_use", "id": call_id(family), "name": "get_weather", "input": ARGUMENTS})
    return [
        *QUESTION,
        {"role": "assistant", "content": blocks},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call_id(family), "content": "sunny, 21 C"}],
        },
    ]


@pytest.fixture(scope="module", params=TINY_FAMILIES)
def family_format(request, tiny_models):
    family = request.param
    config = tiny_config(family, tiny_models[family])
    tokenizer = AutoTokenizer.from_pretrained(tiny_models[family])
    fmt = build_chat_format(
        config.model.chat_format,
        tokenizer,
        content_format=config.model.content_format,
        default_kwargs=dict(config.model.chat_template_kwargs),
    )
    return family, config, fmt


def rendered(fmt, request):
    return fmt.render(request.messages, request.tools, dict(request.chat_template_kwargs or {}))


def as_messages(config, messages, **fields):
    body = {"model": "m", "max_tokens": 10, "messages": messages, "tools": [WEATHER], **fields}
    return chat_request(msgspec.convert(body, MessagesRequest), thinking_kwarg=config.model.thinking_kwarg)


def chat_prompt(fmt, messages, reasoning: str | None = None):
    chat = msgspec.convert({"messages": messages, "tools": TOOLS}, ChatCompletionRequest)
    if reasoning is not None:
        chat.messages[1].reasoning_content = reasoning
    return fmt.render(chat.messages, chat.tools, {})


def test_the_question_is_the_chat_prompt(family_format):
    family, config, fmt = family_format
    thinking = {"type": "enabled", "budget_tokens": 1024}  # on, as these models' defaults: the same prompt
    assert rendered(fmt, as_messages(config, QUESTION, thinking=thinking)).token_ids == (
        chat_prompt(fmt, QUESTION).token_ids
    )


def test_the_tool_round_trip_is_the_chat_prompt(family_format):
    family, config, fmt = family_format
    chat = follow_up(call_id(family), json.dumps(ARGUMENTS))
    assert rendered(fmt, as_messages(config, round_trip(family))).token_ids == chat_prompt(fmt, chat).token_ids


def test_thinking_in_history_is_the_turns_reasoning(family_format):
    family, config, fmt = family_format
    chat = follow_up(call_id(family), json.dumps(ARGUMENTS))
    messages = as_messages(config, round_trip(family, thinking="Weather needed."))
    assert messages.messages[1].reasoning_content == "Weather needed."
    prompt = rendered(fmt, messages)
    assert prompt.token_ids == chat_prompt(fmt, chat, reasoning="Weather needed.").token_ids
    if family == "kimi_k3":  # K3's encoder keeps every assistant turn's reasoning in its think channel
        assert "Weather needed." in prompt.text
