"""thinking_token_budget through the HTTP app in process, on every tiny family with thinking on (the real engine,
random weights: a random model never ends its reasoning by itself, which is where the budget must end it).

The oracle is the tokens the model wrote (chat logprobs), not the server's own count: the tokens between the
opening of reasoning and the family's end marker are never more than the budget, the end follows them, and the
answer follows the end. Reasoning that opens by the model's own `<think>` (GLM-4.5, Qwen3 leave that to it) is
opened here by a logit bias on that token.
"""

from __future__ import annotations

import json

import pytest
from litestar.testing import TestClient

from deltafin.app import build_app
from deltafin.app.services import Services
from deltafin.families import get_family
from deltafin.protocol.chat import ChatCompletionRequest, ChatMessage
from tests.conftest import TINY_FAMILIES, tiny_config

QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
            "required": ["city"],
        },
    },
}


class Served:
    """A tiny family's app; `opener_id` is its `<think>` token where the model opens reasoning itself."""

    def __init__(self, name: str, client: TestClient, config, markup, opener_id: int | None) -> None:
        self.name, self.client, self.config = name, client, config
        self.end = markup.reasoning_markers().ends[0]
        self.opener_id = opener_id

    def post(self, path: str, body: dict) -> dict:
        response = self.client.post(path, json=body)
        assert response.status_code == 200, response.text
        return response.json()


@pytest.fixture(scope="module", params=TINY_FAMILIES)
def served(request, tiny_models):
    name = request.param
    config = tiny_config(name, tiny_models[name], ["server.memo.entries=0"])
    services = Services.load(config)
    family = get_family(config.model.family)
    markup = family.markup(family.variant(config.model.variant))
    prompt = services.chat.render(ChatCompletionRequest(messages=[ChatMessage(**m) for m in QUESTION]))
    auto = markup.reasoning(prompt.text) == "auto"
    opener = services.ctx.engine.tokenizer.convert_tokens_to_ids("<think>") if auto else None
    with TestClient(build_app(config, services)) as client:
        yield Served(name, client, config, markup, opener)


def body(served: Served, budget: int, **extra) -> dict:
    out = {
        "messages": QUESTION,
        "thinking_token_budget": budget,
        "max_tokens": budget + 40,
        "temperature": 1.0,
        "seed": 3,
        "logprobs": True,
        **extra,
    }
    if served.opener_id is not None:
        out["logit_bias"] = {str(served.opener_id): 100}
    return out


def opened_at(served: Served, tokens: list[str]) -> int:
    """Where reasoning begins: at the start, or after the model's own opener."""
    if served.opener_id is None:
        return 0
    start = 0
    while "<think>" not in "".join(tokens[: start + 1]):
        start += 1
    return start + 1


def reasoning_tokens(served: Served, tokens: list[str]) -> tuple[int, int] | None:
    """(reasoning tokens, the index of the first token after the end marker), from the tokens written; None
    when the end never came."""
    start, text = opened_at(served, tokens), ""
    for i in range(start, len(tokens)):
        text += tokens[i]
        if served.end in text:
            first = i
            while served.end not in "".join(tokens[first : i + 1]):
                first -= 1
            return first - start, i + 1
    return None


@pytest.mark.parametrize("budget", [0, 3, 11])
def test_reasoning_never_exceeds_the_budget_and_an_answer_follows(served, budget):
    answer = served.post("/v1/chat/completions", body(served, budget))
    choice = answer["choices"][0]
    tokens = [t["token"] for t in choice["logprobs"]["content"]]
    reported = answer["usage"]["completion_tokens_details"]["reasoning_tokens"]
    found = reasoning_tokens(served, tokens)
    if found is None:  # the model stopped (EOS) inside its reasoning, before the budget ran out
        written = len(tokens) - opened_at(served, tokens)
        assert choice["finish_reason"] == "stop" and written <= budget and reported == written, (served.name, tokens)
        return
    count, after = found
    assert count <= budget and count == reported
    if budget == 0:
        assert count == 0  # forced at once: the end is the first thing reasoning holds
    assert after < len(tokens) or choice["finish_reason"] == "stop", "the model goes on after the end"


def test_streamed_the_same(served):
    plain = served.post("/v1/chat/completions", body(served, 5))
    streamed = served.client.post(
        "/v1/chat/completions",
        json={**body(served, 5), "stream": True, "stream_options": {"include_usage": True}, "logprobs": False},
    )
    assert streamed.status_code == 200
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content") or "" for c in chunks if c["choices"])
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    message = plain["choices"][0]["message"]
    assert reasoning == (message.get("reasoning_content") or "") and content == (message["content"] or "")
    assert chunks[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] == 5


def test_a_forced_tool_call_follows_the_forced_end(served):
    answer = served.post(
        "/v1/chat/completions",
        body(served, 2, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=400),
    )
    choice = answer["choices"][0]
    count, _ = reasoning_tokens(served, [t["token"] for t in choice["logprobs"]["content"]])
    assert count <= 2 and answer["usage"]["completion_tokens_details"]["reasoning_tokens"] == count
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Oslo")


def test_responses_take_it_by_either_name(served):
    for budget_fields in ({"thinking_token_budget": 4}, {"reasoning": {"max_tokens": 4}}):
        request = {"input": "Hi", "max_output_tokens": 30, "temperature": 1.0, **budget_fields}
        if served.opener_id is not None:
            continue  # the Responses API has no logit_bias: such a model may not open reasoning (covered above)
        answer = served.post("/v1/responses", request)
        assert answer["usage"]["output_tokens_details"]["reasoning_tokens"] == 4, (served.name, budget_fields)
        assert answer["output"][0]["type"] == "reasoning"
    refused = served.client.post(
        "/v1/responses", json={"input": "Hi", "thinking_token_budget": 4, "reasoning": {"max_tokens": 5}}
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "reasoning.max_tokens"


def test_thinking_off_leaves_nothing_to_cap(served):
    kwarg = served.config.model.thinking_kwarg
    answer = served.post(
        "/v1/chat/completions", {**body(served, 2), "chat_template_kwargs": {kwarg: False}, "logit_bias": None}
    )
    assert answer["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0


class TestModelsThatDoNotReason:
    """SmolLM2 (the default model) has no reasoning: a budget is a 400 naming the field, as vLLM answers a budget
    on a model served without a reasoning parser, on every API, before anything is generated."""

    @pytest.fixture(scope="class")
    def smollm2(self, config, services):
        with TestClient(build_app(config, services)) as client:
            yield client

    @pytest.mark.parametrize(
        ("path", "request_body", "param"),
        [
            ("/v1/chat/completions", {"messages": QUESTION, "thinking_token_budget": 8}, "thinking_token_budget"),
            ("/v1/completions", {"prompt": "Hi", "thinking_token_budget": 8}, "thinking_token_budget"),
            ("/v1/responses", {"input": "Hi", "thinking_token_budget": 8}, "thinking_token_budget"),
            ("/v1/responses", {"input": "Hi", "reasoning": {"max_tokens": 8}}, "reasoning.max_tokens"),
        ],
    )
    def test_a_budget_is_refused_by_name(self, smollm2, path, request_body, param):
        response = smollm2.post(path, json=request_body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and "does not reason" in error["message"]

    @pytest.mark.parametrize("value", [-1, 1.5, "8", True, [], 2**70])
    def test_values_that_are_not_a_budget_are_400(self, smollm2, value):
        response = smollm2.post("/v1/chat/completions", json={"messages": QUESTION, "thinking_token_budget": value})
        assert response.status_code == 400 and "thinking_token_budget" in response.text

    def test_no_budget_is_no_change(self, smollm2):
        response = smollm2.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 2})
        assert response.status_code == 200 and "completion_tokens_details" not in response.json()["usage"]
