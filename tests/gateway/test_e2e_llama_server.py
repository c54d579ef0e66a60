"""A real foreign engine: the default SmolLM2 GGUF served by llama.cpp's `llama-server`, with a Deltafin gateway
(`engine=llama_server`) in front, driven by the openai client. The llama-server and the gateway are the tier's
(tests/gateway/llama_tier.py): this module's model is one entry of that gateway, and every request names it.
Skipped unless `scripts/build-llama-server` has built the binary (or DELTAFIN_LLAMA_SERVER names one)."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from deltafin.testing.llama_server import llama_server_binary
from tests.gateway.llama_tier import SMOLLM2, gateway_model
from tests.tiers import unavailable

pytestmark = [pytest.mark.e2e, pytest.mark.llama_server]

BINARY = llama_server_binary()
if not BINARY.exists():
    unavailable("llama_server", f"llama-server not built ({BINARY}); run scripts/build-llama-server")

HELLO = [{"role": "user", "content": "Say hello in one sentence."}]
#: the default SmolLM2 through the gateway (SMOLLM2's -c 4096 is shared by its 2 slots)
MODEL = gateway_model("llama-smollm2", SMOLLM2, ["engine.max_inflight=2", "model.context_length=2048"]).name


@pytest.fixture(scope="module")
def llama(llama_tier):
    return llama_tier.gateway, llama_tier.url(SMOLLM2)


def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=300)


def test_greedy_chat_is_llama_servers_own_tokens_decoded_by_deltafin(llama):
    gateway, url = llama
    via = client(gateway).chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, temperature=0)
    prompt = httpx.post(f"{gateway.base_url}/tokenize", json={"model": MODEL, "messages": HELLO}).json()["tokens"]
    direct = httpx.post(
        f"{url}/completion",
        timeout=300,
        json={"prompt": prompt, "n_predict": 8, "temperature": 0, "return_tokens": True, "samplers": ["temperature"]},
    ).json()
    detok = httpx.post(f"{gateway.base_url}/detokenize", json={"model": MODEL, "tokens": direct["tokens"]}).json()[
        "prompt"
    ]
    assert via.choices[0].message.content == detok and via.usage.completion_tokens == 8
    assert via.usage.prompt_tokens == len(prompt)


def test_streaming_logprobs_and_llama_servers_prompt_cache(llama):
    gateway, _ = llama
    chunks = list(
        client(gateway).chat.completions.create(
            model=MODEL,
            messages=HELLO,
            max_tokens=6,
            temperature=0,
            stream=True,
            logprobs=True,
            top_logprobs=2,
            stream_options={"include_usage": True},
        )
    )
    content = [c.choices[0] for c in chunks if c.choices and c.choices[0].delta.content]
    entries = [e for c in content for e in (c.logprobs.content or [])]
    assert len(entries) == 6 and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)
    usage = chunks[-1].usage
    assert usage.completion_tokens == 6
    # the same prompt again (a different max_tokens, so not a memo hit): llama-server reuses its slot's cache
    again = client(gateway).chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_stop_string_and_disconnect(llama):
    gateway, _ = llama
    full = (
        client(gateway)
        .chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, temperature=0)
        .choices[0]
        .message.content
    )
    word = full.split()[1]
    cut = client(gateway).chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, temperature=0, stop=[word])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].message.content == full[: full.index(word)]
    with httpx.stream(
        "POST",
        f"{gateway.base_url}/v1/chat/completions",
        timeout=300,
        json={"model": MODEL, "messages": HELLO, "max_tokens": 500, "ignore_eos": True, "stream": True},
    ) as r:
        for line in r.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                break
    # both slots free again soon: two requests at once complete
    started = time.monotonic()
    client(gateway).chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
    # Generous: two tokens take well under a second; a slot still held by the abandoned stream would keep this
    # request until that stream's remaining tokens (hundreds, ignore_eos) were generated.
    assert time.monotonic() - started < 60
