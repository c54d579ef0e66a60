"""POST /tokenize takes everything that shapes a chat render (tools, tool_choice, response_format,
chat_template_kwargs, reasoning_effort, Kimi's `thinking`) and gives exactly the ids chat would send: through the
HTTP app, in gateway mode over a tiny model's tokenizer (nothing is generated)."""

from __future__ import annotations

import copy

import msgspec
import pytest
from litestar.testing import TestClient

from deltafin.app import build_app
from deltafin.app.services import Services
from deltafin.protocol.chat import ChatCompletionRequest
from deltafin.protocol.decode import decode_request
from tests.conftest import tiny_config
from tests.prompt import oracles

GATEWAY = ["engine=llama_server", "engine.url=http://127.0.0.1:9"]
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Find things",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
    },
}
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}


def app(family, tiny_models, extra=()):
    config = tiny_config(family, tiny_models[family], [*GATEWAY, *extra])
    services = Services.load(config)
    return TestClient(build_app(config, services)), services


@pytest.fixture(scope="module")
def k3(tiny_models):
    client, services = app("kimi_k3", tiny_models)
    with client:
        yield client, services


@pytest.fixture(scope="module")
def k3_para(tiny_models):
    client, services = app("kimi_k3", tiny_models, ["compat=para"])
    with client:
        yield client, services


@pytest.fixture(scope="module")
def qwen3(tiny_models):
    client, services = app("qwen3", tiny_models)
    with client:
        yield client, services


def chat_ids(services, body):
    request = decode_request(msgspec.json.encode(body), ChatCompletionRequest)
    request = services.ctx.rules.on_request(request, services.chat.rule_context(request), [])
    return services.chat.render(request).token_ids


def tokenize(client, body):
    response = client.post("/tokenize", json=body)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def detokenize(client, tokens):
    return client.post("/detokenize", json={"tokens": tokens}).json()["prompt"]


K3_BODY = {
    "messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Find cats."}],
    "tools": [SEARCH],
    "tool_choice": "required",
    "response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": SCHEMA}},
    "reasoning_effort": "low",
}


def test_k3_every_field_that_shapes_the_prompt_is_rendered(k3):
    client, services = k3
    tokens = tokenize(client, K3_BODY)
    assert tokens == chat_ids(services, K3_BODY)
    text = detokenize(client, tokens)
    for part in (
        'type="tool-declare"',
        "`thinking_effort=low`",
        "`tool_choice=required`",
        "`response_format=json_schema`",
        '{"properties":{"answer":{"type":"string"}},"required":["answer"],"type":"object"}',
        'role="system"<|sep|>Be brief.',
    ):
        assert part in text, part
    assert text.endswith('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')


def test_k3_tokenize_is_the_reference_encoder(k3):
    """The text /tokenize gives is K3's own encoder's for the same request (developer as system, as decided)."""
    client, _ = k3
    reference = oracles.k3_encoder()
    messages = copy.deepcopy(K3_BODY["messages"])
    messages[0]["role"] = "system"
    segments = reference.build_chat_segments(
        messages,
        [SEARCH],
        thinking=True,
        thinking_effort="low",
        tool_choice="required",
        response_format=K3_BODY["response_format"],
    )
    assert detokenize(client, tokenize(client, K3_BODY)) == "".join(s.text for s in segments)


@pytest.mark.parametrize(
    "body, ending",
    [
        ({"reasoning_effort": "none"}, "<|open|>response<|sep|>"),
        ({"chat_template_kwargs": {"thinking": False}}, "<|open|>response<|sep|>"),
        ({"thinking": {"type": "disabled"}}, "<|open|>response<|sep|>"),  # compat=para's kimi_thinking rule
        ({"thinking": {"type": "enabled"}}, "<|open|>think<|sep|>"),
    ],
)
def test_k3_thinking_switches(k3_para, body, ending):
    client, services = k3_para
    full = {"messages": [{"role": "user", "content": "hi"}], **body}
    tokens = tokenize(client, full)
    assert detokenize(client, tokens).endswith(ending) and tokens == chat_ids(services, full)


def test_the_rules_shape_tokenize_as_they_shape_chat(k3_para):
    """compat=para serves tool_choice "required" as "auto": no tool-choice message, in /tokenize as in chat."""
    client, services = k3_para
    tokens = tokenize(client, K3_BODY)
    assert tokens == chat_ids(services, K3_BODY) and "`tool_choice=required`" not in detokenize(client, tokens)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"reasoning_effort": "medium"}, "reasoning_effort"),
        ({"chat_template_kwargs": {"thinking_effort": "medium"}}, "chat_template_kwargs.thinking_effort"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        (
            {"messages": [{"role": "user", "content": "go"}, {"role": "tool", "tool_call_id": "x", "content": "?"}]},
            "messages[1]",
        ),
    ],
)
def test_k3_refusals_are_400s_naming_the_field(k3, body, param):
    client, _ = k3
    response = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}], **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_templates_get_reasoning_effort_and_their_kwargs(qwen3):
    client, services = qwen3
    body = {
        "messages": [{"role": "user", "content": " hi "}],
        "tools": [SEARCH],
        "reasoning_effort": "low",
        "chat_template_kwargs": {"enable_thinking": False},
    }
    tokens = tokenize(client, body)
    assert tokens == chat_ids(services, body)
    text = detokenize(client, tokens)
    assert '"name": "search"' in text and text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
