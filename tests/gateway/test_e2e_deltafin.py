"""End to end with real processes: a Deltafin gateway (`engine=vllm`) in front of a second Deltafin that serves
the model, driven by the openai client. The upstream speaks vLLM's token-id completions (`prompt: list[int]`,
`return_token_ids`), so every token crosses the wire as an id and the gateway's own detokenizer and parsers
make the response."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.conftest import LiveServer
from deltafin.tiny.taught import taught
from tests.e2e.test_families import ARGUMENTS, QUESTION, SCRIPTS, TOOLS, follow_up, render

pytestmark = pytest.mark.e2e

HELLO = [{"role": "user", "content": "Say hello in one sentence."}]
STORY = [{"role": "user", "content": "Write a long story about a dragon."}]




@pytest.fixture(scope="module")
def pair():
    upstream = LiveServer([])
    gateway = LiveServer(["engine=vllm", f"engine.url={upstream.base_url}", "engine.connect_timeout_s=1"])
    try:
        upstream.wait_ready()
        gateway.wait_ready()
        yield gateway, upstream
    finally:
        gateway.stop()
        upstream.stop()


def routes_logged(server: LiveServer, request_id: str) -> list[str]:
    server.request_log(request_id)  # waits for the first
    time.sleep(0.2)
    return [json.loads(line)["route"] for line in server.log_lines()
            if f'"request_id": "{request_id}"' in line and '"event": "request"' in line]


def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120)


class TestThroughTheGateway:
    def test_chat_matches_the_upstream_served_directly(self, pair):
        gateway, upstream = pair
        via = client(gateway).chat.completions.create(model="smollm2", messages=HELLO, max_tokens=12, temperature=0)
        direct = client(upstream).chat.completions.create(model="smollm2", messages=HELLO, max_tokens=12, temperature=0)
        assert via.choices[0].message.content == direct.choices[0].message.content
        assert via.usage.prompt_tokens == direct.usage.prompt_tokens
        assert via.usage.completion_tokens == direct.usage.completion_tokens == 12
        line = gateway.request_log(via._request_id)
        assert line["engine"] == "vllm" and line["prefill_ms"] is not None
        # the gateway's request id reached the upstream's log lines: the 404 probe of the generate endpoint,
        # then the token-id completion the vllm adapter falls back to
        assert routes_logged(upstream, via._request_id) == ["/inference/v1/generate", "/v1/completions"]

    def test_responses_match_chat_through_the_gateway(self, pair):
        gateway, _ = pair
        chat = client(gateway).chat.completions.create(model="smollm2", messages=HELLO, max_tokens=12, temperature=0)
        response = client(gateway).responses.create(model="smollm2", input=HELLO, max_output_tokens=12, temperature=0)
        assert response.output_text == chat.choices[0].message.content
        assert response.usage.input_tokens == chat.usage.prompt_tokens

    def test_streaming_with_usage(self, pair):
        gateway, _ = pair
        chunks = list(client(gateway).chat.completions.create(
            model="smollm2", messages=HELLO, max_tokens=10, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        whole = client(gateway).chat.completions.create(model="smollm2", messages=HELLO, max_tokens=10, temperature=0)
        assert text == whole.choices[0].message.content
        assert chunks[-1].usage.completion_tokens == 10

    def test_stop_strings_are_applied_by_the_gateway(self, pair):
        gateway, _ = pair
        full = client(gateway).chat.completions.create(model="smollm2", messages=HELLO, max_tokens=12,
                                                       temperature=0).choices[0].message.content
        word = full.split()[1]
        cut = client(gateway).chat.completions.create(model="smollm2", messages=HELLO, max_tokens=12,
                                                      temperature=0, stop=[word])
        assert cut.choices[0].finish_reason == "stop" and cut.choices[0].message.content == full[: full.index(word)]

    def test_context_overflow_is_checked_by_the_gateway(self, pair):
        gateway, _ = pair
        response = httpx.post(f"{gateway.base_url}/v1/completions",
                              json={"prompt": [1] * 9000, "max_tokens": 1}, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"

    def test_client_disconnect_stops_the_upstream_generation(self, pair):
        gateway, upstream = pair
        request_id = f"cancel-{time.time_ns()}"
        with httpx.stream("POST", f"{gateway.base_url}/v1/chat/completions", headers={"x-request-id": request_id},
                          json={"messages": STORY, "max_tokens": 400, "stream": True, "ignore_eos": True}, timeout=60) as r:
            lines = r.iter_lines()
            assert r.status_code == 200
            for line in lines:
                if '"content":"' in line and '"content":""' not in line:
                    break
        line = upstream.request_log(request_id, timeout=20)
        assert line["completed"] is False and line["completion_tokens"] < 400
        # and the upstream is free again at once: a short request goes through quickly
        started = time.monotonic()
        client(gateway).chat.completions.create(model="smollm2", messages=HELLO, max_tokens=2)
        assert time.monotonic() - started < 30

    def test_token_id_prompt_and_return_token_ids_on_deltafin_itself(self, pair):
        _, upstream = pair
        ids = httpx.post(f"{upstream.base_url}/tokenize", json={"prompt": "The capital of France is"}).json()["tokens"]
        by_text = httpx.post(f"{upstream.base_url}/v1/completions", timeout=60, json={
            "prompt": "The capital of France is", "max_tokens": 5, "temperature": 0}).json()
        by_ids = httpx.post(f"{upstream.base_url}/v1/completions", timeout=60, json={
            "prompt": ids, "max_tokens": 5, "temperature": 0, "return_token_ids": True, "echo": True}).json()
        choice = by_ids["choices"][0]
        assert choice["prompt_token_ids"] == ids and len(choice["token_ids"]) == 5
        assert choice["text"] == "The capital of France is" + by_text["choices"][0]["text"]
        bad = httpx.post(f"{upstream.base_url}/v1/completions", json={"prompt": [1, 10**9], "max_tokens": 1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
        negative = httpx.post(f"{upstream.base_url}/v1/completions", json={"prompt": [-1], "max_tokens": 1})
        assert negative.status_code == 400

    def test_streamed_token_ids_cover_every_generated_token(self, pair):
        _, upstream = pair
        with httpx.stream("POST", f"{upstream.base_url}/v1/completions", timeout=60, json={
                "prompt": [1, 2, 3], "max_tokens": 6, "temperature": 0, "stream": True, "return_token_ids": True}) as r:
            events = [json.loads(l[6:]) for l in r.iter_lines() if l.startswith("data: {")]
        ids = [i for e in events for c in e["choices"] for i in c.get("token_ids", [])]
        assert len(ids) == 6 and events[0]["choices"][0]["prompt_token_ids"] == [1, 2, 3]


class TestUpstreamDownAndBack:
    """Runs last in this module: it stops the upstream and starts a new one on the same port."""

    def test_upstream_down_then_restarted(self, pair):
        gateway, upstream = pair
        upstream.stop()
        down = httpx.post(f"{gateway.base_url}/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2}, timeout=30)
        assert down.status_code == 503 and down.headers["retry-after"]
        error = down.json()["error"]
        assert error["code"] == "upstream_unavailable" and upstream.base_url in error["message"]
        streamed = httpx.post(f"{gateway.base_url}/v1/chat/completions", timeout=30,
                              json={"messages": HELLO, "max_tokens": 2, "stream": True})
        assert streamed.status_code == 503  # known before the first byte: a real status, streaming too
        time.sleep(1.1)  # past the health cache
        health = httpx.get(f"{gateway.base_url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "upstream_unavailable"

        restarted = LiveServer([], port=upstream.port)  # where the gateway expects it
        try:
            restarted.wait_ready()
            # ignore_eos: a sampled answer may otherwise end at EOS before 4 tokens.
            answer = client(gateway).chat.completions.create(model="smollm2", messages=HELLO, max_tokens=4,
                                                             extra_body={"ignore_eos": True})
            assert answer.usage.completion_tokens == 4
            time.sleep(1.1)
            assert httpx.get(f"{gateway.base_url}/health", timeout=10).status_code == 200
        finally:
            restarted.stop()


@pytest.fixture(scope="module")
def glm_pair(tmp_path_factory):
    """A tiny GLM-4.7 taught one scripted tool call, served upstream; the gateway runs the GLM parsers, compat=para."""
    family = "glm47"
    from deltafin.tiny import write_tiny_model

    path = write_tiny_model("glm", tmp_path_factory.mktemp(family) / "model", variant="glm47")
    turn1, turn2 = SCRIPTS[family]
    # The examples of tests/e2e/test_families.py's GLM-4.7: taught once, cached
    path = taught(path, [(render(family, path, QUESTION), turn1),
                         (render(family, path, follow_up("call_any", json.dumps(ARGUMENTS))), turn2)])
    model = ["model=glm", "model.variant=glm47", f"model.path={path}"]
    upstream = LiveServer(model)
    gateway = LiveServer([*model, "compat=para", "engine=vllm", f"engine.url={upstream.base_url}"])
    try:
        upstream.wait_ready()
        gateway.wait_ready()
        yield gateway
    finally:
        gateway.stop()
        upstream.stop()


class TestToolsOnATinyFamilyModel:
    def test_tool_call_parsed_by_the_gateway(self, glm_pair):
        response = client(glm_pair).chat.completions.create(model=client(glm_pair).models.list().data[0].id,
                                                            messages=QUESTION, tools=TOOLS, temperature=0)
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content == "Weather needed."
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == ARGUMENTS
        assert response.usage.completion_tokens_details.reasoning_tokens > 0  # the para rule ran at the gateway

    def test_streamed_tool_call_deltas(self, glm_pair):
        model = client(glm_pair).models.list().data[0].id
        chunks = list(client(glm_pair).chat.completions.create(model=model, messages=QUESTION, tools=TOOLS,
                                                               temperature=0, stream=True))
        calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        assert calls[0].function.name == "get_weather"
        assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == ARGUMENTS
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]

    def test_responses_through_the_gateway_run_the_family_parsers_and_para_rules(self, glm_pair):
        """/v1/responses is the chat path: in front of an upstream, with the GLM parsers and compat=para."""
        api = client(glm_pair)
        tools = [{"type": "function", **TOOLS[0]["function"]}]
        response = api.responses.create(model=api.models.list().data[0].id, input=QUESTION, tools=tools, temperature=0)
        reasoning, call = response.output
        assert reasoning.type == "reasoning" and reasoning.content[0].text == "Weather needed."
        assert call.type == "function_call" and json.loads(call.arguments) == ARGUMENTS
        assert response.usage.output_tokens_details.reasoning_tokens > 0
