"""Tools through a real vLLM: a tiny Qwen3 (the real `Qwen3ForCausalLM`, written by deltafin.tiny, attention heads
of 32 as vLLM's CPU attention needs, taught the family's scripted tool call) served by vLLM with
`--enable-scale-out`, and a gateway pinned to the token-id endpoint (`engine.api=generate`) in front. The tool
call is vLLM's greedy output; Deltafin renders the tools and parses the call (Hermes `<tool_call>` JSON).

One vLLM boot for the module, booted with the tier's others; the gateway is the vLLM tier's one
(tests/gateway/vllm_tier.py), where this model is `tiny-qwen3` beside test_e2e_vllm.py's (whose last test kills
their upstreams: this model's engine and upstream are its own). Skipped when vLLM is not installed (scripts/test
installs it).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from deltafin.testing.vllm_server import VllmServer, installed, vllm_python
from tests.conftest import TINY_OVERRIDES, LiveServer
from tests.e2e.test_families import ARGUMENTS, QUESTION, TOOLS
from tests.gateway.taught import taught_model
from tests.gateway.vllm_tier import vllm_upstreams
from tests.tiers import unavailable

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

if not installed():
    unavailable("vllm", f"vLLM not installed ({vllm_python()}); run scripts/install-vllm")

MODEL = "tiny-qwen3"  # served name on vLLM and Deltafin alike

#: a function the model was not taught to call, with a bounded integer argument (an untaught model's value ends)
OFFSET = {
    "type": "object",
    "properties": {"offset": {"type": "integer", "minimum": -12, "maximum": 14}},
    "required": ["offset"],
}
LOCAL_TIME = {
    "type": "function",
    "function": {"name": "local_time", "description": "Time at a UTC offset", "parameters": OFFSET},
}


class TinyQwen3:
    """The taught tiny Qwen3 (written, or found in the cache, under `root`) on a vLLM of its own (core 1, beside
    test_e2e_vllm.py's replica B, which that module kills; replica A has core 0), and the gateway's model over it."""

    def __init__(self, root) -> None:
        self.model = taught_model("qwen3", root, head_dim=32)
        self.vllm = VllmServer(self.model, name=MODEL, max_model_len=1024, cpus="1", args=("--enable-scale-out",))

    def wait_ready(self) -> None:
        self.vllm.wait_ready()
        print(f"vLLM boot (tiny Qwen3): {self.vllm.boot_s:.0f} s")

    def entries(self) -> dict[str, list[str]]:
        return {
            MODEL: [
                *TINY_OVERRIDES["qwen3"],
                f"model.path={self.model}",
                "engine=vllm",
                f"engine.url={self.vllm.url}",
                "engine.api=generate",
                "server.memo.entries=0",
            ]
        }

    def stop(self) -> None:
        self.vllm.stop()


vllm_upstreams("tiny-qwen3", TinyQwen3)


@pytest.fixture(scope="module")
def served(vllm_tier) -> tuple[VllmServer, LiveServer]:
    """(the tiny Qwen3's vLLM, the tier's gateway); requests to the gateway name MODEL."""
    return vllm_tier.groups["tiny-qwen3"].vllm, vllm_tier.gateway


def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120)


def test_greedy_ids_through_the_generate_endpoint_are_vllms_own(served):
    vllm, gateway = served
    prompt = httpx.post(
        f"{gateway.base_url}/tokenize", json={"model": MODEL, "messages": QUESTION, "tools": TOOLS}
    ).json()["tokens"]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 64, "temperature": 0, "return_token_ids": True}
    response = httpx.post(f"{gateway.base_url}/v1/completions", json=body, timeout=120)
    ours = response.json()["choices"][0]
    theirs = httpx.post(f"{vllm.url}/v1/completions", json=body, timeout=120).json()["choices"][0]
    assert ours["token_ids"] == theirs["token_ids"][: len(ours["token_ids"])]
    assert 8 < len(ours["token_ids"]) < 64  # the family's stop token ended it, not max_tokens
    # generate served it (the gateway's other models, over stock vLLMs, log their own fallback, each with the
    # request id of the request that found the endpoint disabled)
    request_id = response.headers["x-request-id"]
    assert not [line for line in gateway.log_lines() if "upstream_api_fallback" in line and request_id in line]


def test_vllms_tool_call_reaches_the_openai_client_parsed(served):
    _, gateway = served
    response = client(gateway).chat.completions.create(
        model=MODEL, messages=QUESTION, tools=TOOLS, temperature=0, logprobs=True, top_logprobs=2
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content == "Weather needed."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == ARGUMENTS
    entries = choice.logprobs.content  # vLLM's generate endpoint reports them by token id
    assert len(entries) == response.usage.completion_tokens - 1  # all but the stop token
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)


def test_streamed_tool_call_from_vllm(served):
    _, gateway = served
    chunks = list(
        client(gateway).chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, temperature=0, stream=True)
    )
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].function.name == "get_weather"
    assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == ARGUMENTS
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_a_named_tool_choice_is_enforced_by_vllm(served):
    """A function the model was not taught to call: forced by the structural tag sent as vLLM's
    `structured_outputs`, the call comes back named, its argument valid under the schema."""
    _, gateway = served
    tools = TOOLS + [LOCAL_TIME]
    unforced = client(gateway).chat.completions.create(model=MODEL, messages=QUESTION, tools=tools, temperature=0)
    assert "local_time" not in [c.function.name for c in unforced.choices[0].message.tool_calls or ()]
    forced = (
        client(gateway)
        .chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            tools=tools,
            temperature=0,
            max_tokens=200,
            tool_choice={"type": "function", "function": {"name": "local_time"}},
        )
        .choices[0]
    )
    assert forced.finish_reason == "tool_calls"
    (call,) = forced.message.tool_calls
    assert call.function.name == "local_time" and -12 <= json.loads(call.function.arguments)["offset"] <= 14


def test_a_thinking_budget_vllm_refuses_is_held_by_deltafin(served):
    """This vLLM runs without a reasoning parser, so it answers a `thinking_token_budget` with a 400: the gateway
    asks again without it and holds the budget itself. The model writes `<think>Weather needed.</think>`
    (`W`, `eather`, ... in the tiny vocabulary); two reasoning tokens in, the next would pass the budget, so the
    gateway closes that request and resumes the choice in a new one whose prompt ends with the forced `</think>`,
    under the forced call's grammar as it reads after reasoning: the named call follows the cut reasoning. The
    forced function takes a bounded integer: after a cut the tiny model is out of its teaching, and a free-text
    argument (get_weather's city) can run on to max_tokens inside its string on some taught weights."""
    _, gateway = served
    forced = client(gateway).chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        tools=TOOLS + [LOCAL_TIME],
        temperature=0,
        max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "local_time"}},
        extra_body={"thinking_token_budget": 2},
    )
    choice = forced.choices[0]
    assert forced.usage.completion_tokens_details.reasoning_tokens == 2
    assert choice.message.reasoning_content == "Weather" and choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "local_time" and -12 <= json.loads(call.function.arguments)["offset"] <= 14
    assert [line for line in gateway.log_lines() if "upstream_budget_fallback" in line]
