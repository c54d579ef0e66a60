"""Tiny family models through llama.cpp's `llama-server`: converted to GGUF by llama.cpp's own converter
(deltafin/tiny/gguf.py), served by the real binary, with a Deltafin gateway (`engine=llama_server`) in front
and a local Deltafin (the torch engine) on the same weights beside it. GLM-4.7 by default, Kimi K2 on request
(SERVED below). Skipped unless scripts/build-llama-server has built the binary (or DELTAFIN_LLAMA_SERVER
names one). The servers are shared: each family is one entry of the tier's gateway (tests/gateway/llama_tier.py)
and one of the shared local server (tests/shared_server.py), and every request names its entry.

Each model is taught one scripted tool call first (deltafin/tiny/taught.py): random weights give nearly flat
logits, where the small float differences between torch and ggml (up to about 1e-3 in a logprob, with
llama-server's f16 KV cache) could flip a greedy pick; taught tokens win by a wide margin, and the tool call
is then the model's own output, produced by llama.cpp.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple

import httpx
import openai
import pytest

from deltafin.testing.llama_server import llama_server_binary, start_llama_server
from deltafin.tiny import write_tiny_model
from deltafin.tiny.gguf import tiny_gguf
from tests.conftest import TINY_OVERRIDES, TINY_SPECS, LiveServer
from tests.e2e.test_families import ARGUMENTS, KIMI_ID, QUESTION, TOOLS
from tests.gateway.llama_tier import Upstream, gateway_model
from tests.gateway.taught import taught_model
from tests.shared_server import shared_model
from tests.tiers import unavailable

pytestmark = [pytest.mark.e2e, pytest.mark.llama_server]

BINARY = llama_server_binary()
if not BINARY.exists():
    unavailable("llama_server", f"llama-server not built ({BINARY}); run scripts/build-llama-server")

#: tiny model -> the markers of its tool-call syntax, each one control token of its vocabulary
MARKERS = {
    "glm47": {"<tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "</tool_call>"},
    "kimi_k2": {
        "<|tool_calls_section_begin|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
        "<|tool_calls_section_end|>",
    },
}
UNTAUGHT = [{"role": "user", "content": "hello"}]
#: the function a call is forced to; a bounded integer argument, so even an untrained model's value ends
OFFSET = {
    "type": "object",
    "properties": {"offset": {"type": "integer", "minimum": -12, "maximum": 14}},
    "required": ["offset"],
}
LOCAL_TIME = {
    "type": "function",
    "function": {"name": "local_time", "description": "Time at a UTC offset", "parameters": OFFSET},
}


class Served(NamedTuple):
    """A Deltafin serving the model, and the entry name its requests send as `model`."""

    server: LiveServer
    model: str


class Servers(NamedTuple):
    name: str
    model: Path
    llama_url: str
    gateway: Served
    local: Served


#: the tiny models served end to end: each is one more llama-server and one more entry of the gateway and of the
#: shared local server (each entry's load costs seconds), so by default only GLM-4.7;
#: DELTAFIN_LLAMA_FAMILIES=glm47,kimi_k2 adds Kimi K2 (whose conversion is always checked, by
#: test_tiny_kimi_k2_runs_in_llama_cpp_as_in_torch)
SERVED = os.environ.get("DELTAFIN_LLAMA_FAMILIES", "glm47").split(",")

_TAUGHT: dict[str, Path] = {}


def taught(name: str, root: Path) -> Path:
    """The family's taught model folder, written once per session: llama-server's GGUF, the gateway's tokenizer
    and the local server's weights are all this one folder."""
    if name not in _TAUGHT:
        _TAUGHT[name] = taught_model(name, root)
    return _TAUGHT[name]


def served_overrides(name: str, model: Path) -> list[str]:
    """The model, under compat=para less the rule that serves a named tool_choice as auto (so a call can be
    enforced): what both Deltafins serve."""
    return [*TINY_OVERRIDES[name], f"model.path={model}", "compat=para", "~compat.rules.force_tool_choice_auto"]


def declare(name: str) -> tuple[Upstream, str, str]:
    """llama-server on the family's GGUF, the gateway's entry in front of it, the shared local server's entry on
    the same model folder: (the upstream, the gateway's model name, the local model name)."""

    def prepare(root: Path) -> tuple[Path, Path]:
        model = taught(name, root)
        return model, tiny_gguf(model)

    def local_entry(root: Path) -> tuple[Path, list[str]]:
        model = taught(name, root)
        return model, served_overrides(name, model)

    upstream = Upstream(f"tiny-{name}", prepare, parallel=1, context=4096)
    gateway = gateway_model(
        f"llama-gateway-{name}", upstream, lambda model: [*served_overrides(name, model), "engine.max_inflight=1"]
    )
    local = shared_model(f"llama-local-{name}", local_entry)
    return upstream, gateway.name, local.name


DECLARED = {name: declare(name) for name in SERVED}


@pytest.fixture(scope="module", params=SERVED)
def servers(request, llama_tier, local_server):
    """llama-server on the GGUF, the gateway's entry in front of it, the local server's entry on the same folder."""
    upstream, gateway, local = DECLARED[request.param]
    return Servers(
        request.param,
        llama_tier.folder(upstream),
        llama_tier.url(upstream),
        Served(llama_tier.gateway, gateway),
        Served(local_server, local),
    )


def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.server.base_url}/v1", api_key="x", max_retries=0, timeout=120)


def greedy_ids(served: Served, prompt: list[int], max_tokens: int, **extra) -> list[int]:
    body = {
        "model": served.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        **extra,
    }
    response = httpx.post(f"{served.server.base_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def prompt_ids(served: Served, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    body = {"model": served.model, "messages": messages, "tools": tools}
    return httpx.post(f"{served.server.base_url}/tokenize", json=body).json()["tokens"]


def test_llama_server_holds_the_tiny_vocabulary_id_for_id(servers):
    """Every id decodes to the same bytes in llama.cpp as in the HF tokenizer (special tokens as their text), and
    llama.cpp's own tokenizer splits text as the HF one does: the `gpt-2` pre-tokenizer the converter was told
    is the tokenizer's real one."""
    from transformers import AutoTokenizer

    url, tokenizer = servers.llama_url, AutoTokenizer.from_pretrained(servers.model)
    with httpx.Client(base_url=url) as http:
        for token_id in range(len(tokenizer)):
            llama = http.post("/detokenize", json={"tokens": [token_id]}).json()["content"]
            assert llama == tokenizer.decode([token_id]), token_id
    text = "What is the weather in Paris today? It's 21 C, isn't it?\n\n  def main(): return 1 + 2  # 0123"
    assert httpx.post(f"{url}/tokenize", json={"content": text}).json()["tokens"] == tokenizer(text).input_ids


@pytest.mark.parametrize("messages", [QUESTION, UNTAUGHT], ids=["taught", "untaught"])
def test_greedy_token_ids_are_the_local_engines(servers, messages):
    """One prompt, greedy, to the stop token: llama-server (through the gateway) and the torch engine pick the
    same token ids. The whole sequence is compared: after teaching, the top two logprobs of every step on
    these prompts differ by more than 0.08 (measured), while ggml and torch differ by about 1e-3 at most."""
    gateway, local = servers.gateway, servers.local
    tools = TOOLS if messages is QUESTION else None
    prompt = prompt_ids(local, messages, tools)
    assert prompt_ids(gateway, messages, tools) == prompt
    upstream, own = greedy_ids(gateway, prompt, 64), greedy_ids(local, prompt, 64)
    assert upstream == own and 8 < len(own) < 64  # ended by the family's stop token, not by max_tokens


def test_llama_servers_tool_call_reaches_the_openai_client_parsed(servers):
    """tool_choice auto: the call is llama.cpp's greedy output, parsed by the family's parsers."""
    gateway = servers.gateway
    response = client(gateway).chat.completions.create(
        model=gateway.model, messages=QUESTION, tools=TOOLS, temperature=0
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == "Weather needed." and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == ARGUMENTS
    if servers.name == "kimi_k2":
        assert call.id == KIMI_ID  # the id is the model's own text, as K2 writes it
    else:
        assert response.usage.completion_tokens_details.reasoning_tokens > 0  # compat=para's GLM usage rule


def test_streamed_tool_call_from_llama_server(servers):
    gateway = servers.gateway
    chunks = list(
        client(gateway).chat.completions.create(
            model=gateway.model, messages=QUESTION, tools=TOOLS, temperature=0, stream=True
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert calls[0].function.name == "get_weather"
    assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == ARGUMENTS
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_enforced_tool_call_through_llama_servers_grammar(servers):
    """tool_choice names a function the model was not taught to call: the gateway sends the call's syntax to
    llama-server as GBNF, so the named call comes back, parsed, with its required argument in range, and its
    markers are the GGUF's control tokens, not text spelled in pieces. (Not compared with the local engine: on
    this untaught prompt the free reasoning before the call has near-ties.)"""
    gateway, tools = servers.gateway, TOOLS + [LOCAL_TIME]
    unforced = client(gateway).chat.completions.create(
        model=gateway.model, messages=QUESTION, tools=tools, temperature=0
    )
    # what the grammar overrules: left alone, the model does not call local_time
    assert "local_time" not in [c.function.name for c in unforced.choices[0].message.tool_calls or ()]
    forced = (
        client(gateway)
        .chat.completions.create(
            model=gateway.model,
            messages=QUESTION,
            tools=tools,
            temperature=0,
            max_tokens=200,
            logprobs=True,
            tool_choice={"type": "function", "function": {"name": "local_time"}},
        )
        .choices[0]
    )
    assert forced.finish_reason == "tool_calls"
    (call,) = forced.message.tool_calls
    assert call.function.name == "local_time" and -12 <= json.loads(call.function.arguments)["offset"] <= 14
    assert MARKERS[servers.name] <= {entry.token for entry in forced.logprobs.content}


@pytest.mark.parametrize("budget", [0, 1])
def test_a_thinking_budget_is_llama_servers_own_at_the_local_engines_count(servers, budget):
    """The gateway sends the budget as llama-server's own (`reasoning_budget_tokens`, the family's tags): llama.cpp
    forces the end of reasoning where the local engine forces it, after `budget` reasoning tokens (the taught
    reasoning is longer), so the ids agree up to the forced end (after it the taught model is off its script,
    where ggml and torch may part on near-ties). Before a forced call the call follows the end."""
    gateway, local = servers.gateway, servers.local
    prompt = prompt_ids(local, QUESTION, TOOLS)
    end = httpx.post(f"{servers.llama_url}/tokenize", json={"content": "</think>", "parse_special": True}).json()
    upstream = greedy_ids(gateway, prompt, 12, thinking_token_budget=budget)
    own = greedy_ids(local, prompt, 12, thinking_token_budget=budget)
    assert upstream[: budget + 1] == own[: budget + 1] and upstream[budget] == end["tokens"][0]
    forced = client(gateway).chat.completions.create(
        model=gateway.model,
        messages=QUESTION,
        tools=TOOLS,
        temperature=0,
        max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        extra_body={"thinking_token_budget": budget},
    )
    assert forced.usage.completion_tokens_details.reasoning_tokens == budget
    assert forced.choices[0].finish_reason == "tool_calls"
    (call,) = forced.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments), dict)


def test_tiny_kimi_k2_runs_in_llama_cpp_as_in_torch(tmp_path):
    """Kimi's architecture (DeepseekV3: MLA attention, sigmoid-routed MoE -> llama.cpp `deepseek2`) converts with
    the same override, and llama.cpp's logprobs along its own greedy continuation are torch's on that sequence.
    Compared by value, not rank: untaught logits are near-flat, so ranks may tie where the values agree. The bound
    allows for llama-server's f16 KV cache (measured: up to 1.4e-3) and is far below the logprobs' own spread."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    family, variant = TINY_SPECS["kimi_k2"]
    path = write_tiny_model(family, tmp_path / "kimi_k2", variant=variant)
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer.apply_chat_template(QUESTION, tools=TOOLS, add_generation_prompt=True, return_dict=True)[
        "input_ids"
    ]
    process, url = start_llama_server(tiny_gguf(path), parallel=1, context=4096)
    try:
        body = {
            "prompt": ids,
            "n_predict": 12,
            "n_probs": 5,
            "samplers": ["temperature"],
            "temperature": 0,
            "return_tokens": True,
        }
        answer = httpx.post(f"{url}/completion", json=body, timeout=60).json()
    finally:
        process.terminate()
        process.wait(timeout=15)
    steps, tokens = answer["completion_probabilities"], answer["tokens"]
    assert len(tokens) == 12 and len(steps) >= 6
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(torch.tensor([ids + tokens])).logits
    expected = logits[0, len(ids) - 1 :].log_softmax(-1)
    assert expected.std(-1).min() > 0.1  # the bound stays a tenth of the spread between tokens' logprobs
    position = -1
    for step in steps:
        # llama-server leaves out the entry of a token that ends inside a UTF-8 character: find each one's place
        position = tokens.index(step["id"], position + 1)
        for top in step["top_logprobs"]:
            assert abs(top["logprob"] - expected[position, top["id"]].item()) < 1e-2, (position, top)


def test_tiny_kimi_k3_runs_in_llama_cpp_as_in_deltafin(tmp_path):
    """The tiny K3 in the released layout, every released feature on, converted by llama.cpp's own converter (its
    `kimi_k3` conversion: attention-residual scores, latent experts, SiTU, the bounded KDA gate) and served by
    llama-server's `kimi-k3` graph: a second implementation of K3 beside the reference. Its greedy continuation
    of a K3 chat prompt is Deltafin's K3 model's, and its logprobs along it are Deltafin's (the bound as for K2:
    f16 KV cache; measured 4e-4)."""
    import torch

    from deltafin.engine.weights.architecture import model_source, read_config
    from tests.e2e.test_families import render

    family, variant = TINY_SPECS["kimi_k3"]
    path = write_tiny_model(family, tmp_path / "kimi_k3", variant=variant)
    ids = render("kimi_k3", path, QUESTION)
    process, url = start_llama_server(tiny_gguf(path), parallel=1, context=4096)
    try:
        body = {
            "prompt": ids,
            "n_predict": 16,
            "n_probs": 5,
            "samplers": ["temperature"],
            "temperature": 0,
            "return_tokens": True,
        }
        answer = httpx.post(f"{url}/completion", json=body, timeout=120).json()
    finally:
        process.terminate()
        process.wait(timeout=15)
    steps, tokens = answer["completion_probabilities"], answer["tokens"]
    assert len(tokens) == 16 and len(steps) >= 8
    source, _ = model_source(read_config(path))
    model = source.model_class.from_pretrained(
        path, config=source.config, key_mapping=source.key_mapping, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids + tokens])).logits
    expected = logits[0, len(ids) - 1 :].log_softmax(-1)
    assert expected[:-1].argmax(-1).tolist() == tokens
    assert expected.std(-1).min() > 0.1
    position = -1
    for step in steps:
        position = tokens.index(step["id"], position + 1)
        for top in step["top_logprobs"]:
            assert abs(top["logprob"] - expected[position, top["id"]].item()) < 1e-2, (position, top)
