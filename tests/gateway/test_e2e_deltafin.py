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

from tests.conftest import API_KEYS, LiveServer
from tests.e2e.test_families import ARGUMENTS, QUESTION, TAUGHT, TOOLS
from tests.shared_server import entry_override

pytestmark = pytest.mark.e2e

HELLO = [{"role": "user", "content": "Say hello in one sentence."}]
STORY = [{"role": "user", "content": "Write a long story about a dragon."}]


#: the gateway's second model: the families test's taught GLM-4.7, served upstream by the shared local server
#: (tests/shared_server.py); the gateway runs the GLM parsers and compat=para
GLM_PARA = "glm-para"


@pytest.fixture(scope="module")
def gateway(keyed_server, local_server):
    """One gateway (`engine=vllm`) for two models: its main model, the default, in front of the keyed server
    (tests/conftest.py), and GLM_PARA in front of the shared local server's taught GLM-4.7."""
    glm = TAUGHT["glm47"]
    served = LiveServer(
        [
            "engine=vllm",
            f"engine.url={keyed_server.base_url}",
            "engine.connect_timeout_s=1",
            f"engine.api_key={API_KEYS[0]}",
            entry_override(
                GLM_PARA,
                [
                    "model=glm",
                    "model.variant=glm47",
                    f"model.path={glm.folder}",
                    "compat=para",
                    "engine=vllm",
                    f"engine.url={local_server.base_url}",
                    f"engine.model={glm.name}",
                ],
            ),
        ]
    )
    try:
        served.wait_ready()
        yield served
    finally:
        served.stop()


@pytest.fixture(scope="module")
def pair(gateway, keyed_server):
    return gateway, keyed_server


def routes_logged(server: LiveServer, request_id: str) -> list[str]:
    server.request_log(request_id)  # waits for the first
    time.sleep(0.2)
    return [
        json.loads(line)["route"]
        for line in server.log_lines()
        if f'"request_id": "{request_id}"' in line and '"event": "request"' in line
    ]


def client(server: LiveServer) -> openai.OpenAI:
    """The openai client with the keyed upstream's key (the gateway takes any)."""
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEYS[0], max_retries=0, timeout=120)


def post(server: LiveServer, path: str, **kwargs) -> httpx.Response:
    """httpx.post with the keyed upstream's key."""
    return httpx.post(f"{server.base_url}{path}", headers={"authorization": f"Bearer {API_KEYS[0]}"}, **kwargs)


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
        chunks = list(
            client(gateway).chat.completions.create(
                model="smollm2",
                messages=HELLO,
                max_tokens=10,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        whole = client(gateway).chat.completions.create(model="smollm2", messages=HELLO, max_tokens=10, temperature=0)
        assert text == whole.choices[0].message.content
        assert chunks[-1].usage.completion_tokens == 10

    def test_stop_strings_are_applied_by_the_gateway(self, pair):
        gateway, _ = pair
        full = (
            client(gateway)
            .chat.completions.create(model="smollm2", messages=HELLO, max_tokens=12, temperature=0)
            .choices[0]
            .message.content
        )
        word = full.split()[1]
        cut = client(gateway).chat.completions.create(
            model="smollm2", messages=HELLO, max_tokens=12, temperature=0, stop=[word]
        )
        assert cut.choices[0].finish_reason == "stop" and cut.choices[0].message.content == full[: full.index(word)]

    def test_context_overflow_is_checked_by_the_gateway(self, pair):
        gateway, _ = pair
        response = httpx.post(
            f"{gateway.base_url}/v1/completions", json={"prompt": [1] * 9000, "max_tokens": 1}, timeout=60
        )
        assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"

    def test_client_disconnect_stops_the_upstream_generation(self, pair):
        gateway, upstream = pair
        request_id = f"cancel-{time.time_ns()}"
        with httpx.stream(
            "POST",
            f"{gateway.base_url}/v1/chat/completions",
            headers={"x-request-id": request_id},
            json={"messages": STORY, "max_tokens": 400, "stream": True, "ignore_eos": True},
            timeout=60,
        ) as r:
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
        # Generous: two tokens take well under a second; an upstream still generating the abandoned request
        # (hundreds of tokens left) would hold this one far longer.
        assert time.monotonic() - started < 30

    def test_token_id_prompt_and_return_token_ids_on_deltafin_itself(self, pair):
        _, upstream = pair
        ids = post(upstream, "/tokenize", json={"prompt": "The capital of France is"}).json()["tokens"]
        by_text = post(
            upstream,
            "/v1/completions",
            timeout=60,
            json={"prompt": "The capital of France is", "max_tokens": 5, "temperature": 0},
        ).json()
        by_ids = post(
            upstream,
            "/v1/completions",
            timeout=60,
            json={"prompt": ids, "max_tokens": 5, "temperature": 0, "return_token_ids": True, "echo": True},
        ).json()
        choice = by_ids["choices"][0]
        assert choice["prompt_token_ids"] == ids and len(choice["token_ids"]) == 5
        assert choice["text"] == "The capital of France is" + by_text["choices"][0]["text"]
        bad = post(upstream, "/v1/completions", json={"prompt": [1, 10**9], "max_tokens": 1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
        negative = post(upstream, "/v1/completions", json={"prompt": [-1], "max_tokens": 1})
        assert negative.status_code == 400

    def test_streamed_token_ids_cover_every_generated_token(self, pair):
        _, upstream = pair
        with httpx.stream(
            "POST",
            f"{upstream.base_url}/v1/completions",
            timeout=60,
            headers={"authorization": f"Bearer {API_KEYS[0]}"},
            json={"prompt": [1, 2, 3], "max_tokens": 6, "temperature": 0, "stream": True, "return_token_ids": True},
        ) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        ids = [i for e in events for c in e["choices"] for i in c.get("token_ids", [])]
        assert len(ids) == 6 and events[0]["choices"][0]["prompt_token_ids"] == [1, 2, 3]


class TestUpstreamDownAndBack:
    """It stops the upstream and starts it again on the same port (the tool tests after it use the gateway's
    other model, whose upstream stays up)."""

    def test_upstream_down_then_restarted(self, pair):
        gateway, upstream = pair
        upstream.stop()
        down = httpx.post(
            f"{gateway.base_url}/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2}, timeout=30
        )
        assert down.status_code == 503 and down.headers["retry-after"]
        error = down.json()["error"]
        assert error["code"] == "upstream_unavailable" and upstream.base_url in error["message"]
        streamed = httpx.post(
            f"{gateway.base_url}/v1/chat/completions",
            timeout=30,
            json={"messages": HELLO, "max_tokens": 2, "stream": True},
        )
        assert streamed.status_code == 503  # known before the first byte: a real status, streaming too
        time.sleep(1.1)  # past the health cache
        health = httpx.get(f"{gateway.base_url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "upstream_unavailable"

        upstream.restart()  # where the gateway expects it
        upstream.wait_ready()
        # ignore_eos: a sampled answer may otherwise end at EOS before 4 tokens.
        answer = client(gateway).chat.completions.create(
            model="smollm2", messages=HELLO, max_tokens=4, extra_body={"ignore_eos": True}
        )
        assert answer.usage.completion_tokens == 4
        time.sleep(1.1)
        assert httpx.get(f"{gateway.base_url}/health", timeout=10).status_code == 200


@pytest.fixture(scope="module")
def glm_pair(gateway):
    return gateway


class TestToolsOnATinyFamilyModel:
    def test_tool_call_parsed_by_the_gateway(self, glm_pair):
        response = client(glm_pair).chat.completions.create(
            model=GLM_PARA, messages=QUESTION, tools=TOOLS, temperature=0
        )
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content == "Weather needed."
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == ARGUMENTS
        assert response.usage.completion_tokens_details.reasoning_tokens > 0  # the para rule ran at the gateway

    def test_streamed_tool_call_deltas(self, glm_pair):
        model = GLM_PARA
        chunks = list(
            client(glm_pair).chat.completions.create(
                model=model, messages=QUESTION, tools=TOOLS, temperature=0, stream=True
            )
        )
        calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        assert calls[0].function.name == "get_weather"
        assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == ARGUMENTS
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
            "tool_calls"
        ]

    def test_responses_through_the_gateway_run_the_family_parsers_and_para_rules(self, glm_pair):
        """/v1/responses is the chat path: in front of an upstream, with the GLM parsers and compat=para."""
        api = client(glm_pair)
        tools = [{"type": "function", **TOOLS[0]["function"]}]
        response = api.responses.create(model=GLM_PARA, input=QUESTION, tools=tools, temperature=0)
        reasoning, call = response.output
        assert reasoning.type == "reasoning" and reasoning.content[0].text == "Weather needed."
        assert call.type == "function_call" and json.loads(call.arguments) == ARGUMENTS
        assert response.usage.output_tokens_details.reasoning_tokens > 0
