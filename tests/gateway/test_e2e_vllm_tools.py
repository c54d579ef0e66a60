"""Tools through a real vLLM: a tiny Qwen3 (the real `Qwen3ForCausalLM`, written by deltafin.tiny, attention heads
of 32 as vLLM's CPU attention needs, taught the family's scripted tool call) served by vLLM with
`--enable-scale-out`, and a gateway pinned to the token-id endpoint (`engine.api=generate`) in front. The tool
call is vLLM's greedy output; Deltafin renders the tools and parses the call (Hermes `<tool_call>` JSON).

One vLLM boot for the module. Skipped when vLLM is not installed (scripts/test installs it).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.conftest import TINY_OVERRIDES, LiveServer
from tests.e2e.test_families import ARGUMENTS, QUESTION, TOOLS, client_model
from tests.gateway.taught import taught_model
from deltafin.testing.vllm_server import VllmServer, installed, vllm_python
from tests.tiers import unavailable

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

if not installed():
    unavailable("vllm", f"vLLM not installed ({vllm_python()}); run scripts/install-vllm")

#: a function the model was not taught to call, with a bounded integer argument (an untaught model's value ends)
OFFSET = {"type": "object", "properties": {"offset": {"type": "integer", "minimum": -12, "maximum": 14}},
          "required": ["offset"]}
LOCAL_TIME = {"type": "function",
              "function": {"name": "local_time", "description": "Time at a UTC offset", "parameters": OFFSET}}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = taught_model("qwen3", tmp_path_factory.mktemp("qwen3"), head_dim=32)
    vllm = VllmServer(model, name="tiny-qwen3", max_model_len=1024, args=("--enable-scale-out",))
    try:
        vllm.wait_ready()
        print(f"vLLM boot (tiny Qwen3): {vllm.boot_s:.0f} s")
        gateway = LiveServer([*TINY_OVERRIDES["qwen3"], f"model.path={model}", "engine=vllm", f"engine.url={vllm.url}",
                              "engine.api=generate", "server.memo.entries=0"])
        try:
            gateway.wait_ready()
            yield vllm, gateway
        finally:
            gateway.stop()
    finally:
        vllm.stop()


def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120)


def test_greedy_ids_through_the_generate_endpoint_are_vllms_own(served):
    vllm, gateway = served
    prompt = httpx.post(f"{gateway.base_url}/tokenize", json={"messages": QUESTION, "tools": TOOLS}).json()["tokens"]
    body = {"prompt": prompt, "max_tokens": 64, "temperature": 0, "return_token_ids": True}
    ours = httpx.post(f"{gateway.base_url}/v1/completions", json=body, timeout=120).json()["choices"][0]
    theirs = httpx.post(f"{vllm.url}/v1/completions", json=body, timeout=120).json()["choices"][0]
    assert ours["token_ids"] == theirs["token_ids"][: len(ours["token_ids"])]
    assert 8 < len(ours["token_ids"]) < 64  # the family's stop token ended it, not max_tokens
    assert not [line for line in gateway.log_lines() if "upstream_api_fallback" in line]  # generate served it


def test_vllms_tool_call_reaches_the_openai_client_parsed(served):
    _, gateway = served
    response = client(gateway).chat.completions.create(model=client_model(gateway), messages=QUESTION, tools=TOOLS,
                                                       temperature=0, logprobs=True, top_logprobs=2)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content == "Weather needed."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == ARGUMENTS
    entries = choice.logprobs.content  # vLLM's generate endpoint reports them by token id
    assert len(entries) == response.usage.completion_tokens - 1  # all but the stop token
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)


def test_streamed_tool_call_from_vllm(served):
    _, gateway = served
    chunks = list(client(gateway).chat.completions.create(model=client_model(gateway), messages=QUESTION,
                                                          tools=TOOLS, temperature=0, stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].function.name == "get_weather"
    assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == ARGUMENTS
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_a_named_tool_choice_is_enforced_by_vllm(served):
    """A function the model was not taught to call: forced by the structural tag sent as vLLM's
    `structured_outputs`, the call comes back named, its argument valid under the schema."""
    _, gateway = served
    tools = TOOLS + [LOCAL_TIME]
    model = client_model(gateway)
    unforced = client(gateway).chat.completions.create(model=model, messages=QUESTION, tools=tools, temperature=0)
    assert "local_time" not in [c.function.name for c in unforced.choices[0].message.tool_calls or ()]
    forced = client(gateway).chat.completions.create(
        model=model, messages=QUESTION, tools=tools, temperature=0, max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "local_time"}}).choices[0]
    assert forced.finish_reason == "tool_calls"
    (call,) = forced.message.tool_calls
    assert call.function.name == "local_time" and -12 <= json.loads(call.function.arguments)["offset"] <= 14
