"""/v1/messages and /v1/messages/count_tokens in process (the real default model and engine, no network): the raw
SSE event order, Anthropic-shaped errors on every failure of these routes, both API-key headers, the exact 400
text Claude Code parses, max_tokens cut to what fits, and the billing-header line dropped so the prefix cache
reuses Claude Code's long system prompt across sessions."""

from __future__ import annotations

import json
import re

import pytest
from litestar.testing import TestClient

from deltafin.app import build_app
from tests.conftest import compose_config

MESSAGES = "/v1/messages"
COUNT = "/v1/messages/count_tokens"
#: a long, stable system prompt (~600 tokens), like Claude Code's
SYSTEM = " ".join(f"Rule {i}: answer briefly and stay on the topic of the user's question." for i in range(40))


def ask(text: str = "Say hi.", **fields) -> dict:
    return {
        "model": "smollm2",
        "max_tokens": 3,
        "temperature": 0,
        "messages": [{"role": "user", "content": text}],
        **fields,
    }


def billing(version: str) -> dict:
    return {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.332.{version}; cc_entrypoint=sdk-cli;"}


@pytest.fixture(scope="module")
def client(config, services):
    with TestClient(build_app(config, services)) as client:
        yield client


@pytest.fixture(scope="module")
def keyed(services):
    with TestClient(build_app(compose_config(["server.api_keys=[k1]"]), services)) as client:
        yield client


def assert_anthropic_error(response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == kind and body["error"]["message"]
    assert body["request_id"] == response.headers["request-id"] and body["request_id"].startswith("req_")
    return body["error"]["message"]


def events(response) -> list[tuple[str, dict]]:
    """(event name, data) of each SSE event; the data's `type` is always the event's name."""
    out = []
    for block in response.text.strip().split("\n\n"):
        name = re.fullmatch(r"event: (\S+)\ndata: (.*)", block, re.S)
        assert name is not None, block
        data = json.loads(name.group(2))
        assert data["type"] == name.group(1)
        out.append((name.group(1), data))
    return out


class TestCreate:
    def test_message(self, client):
        response = client.post(MESSAGES + "?beta=true", json=ask(), headers={"anthropic-version": "2023-06-01"})
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["type"] == "message" and body["role"] == "assistant" and body["model"] == "smollm2"
        assert body["id"].startswith("msg_") and response.headers["request-id"].startswith("req_")
        assert [block["type"] for block in body["content"]] == ["text"] and body["content"][0]["text"]
        assert body["stop_reason"] in ("end_turn", "max_tokens") and body["usage"]["output_tokens"] <= 3

    def test_stream_event_order(self, client):
        response = client.post(MESSAGES, json=ask(stream=True, max_tokens=4), headers={"anthropic-beta": "x,y"})
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        names = [name for name, _ in events(response)]
        assert re.fullmatch(
            r"message_start (ping )+content_block_start (content_block_delta )+content_block_stop "
            r"message_delta message_stop ",
            " ".join(names) + " ",
        ), names
        (_, start), *_, (_, delta), _ = events(response)
        assert start["message"]["usage"]["input_tokens"] > 0 and start["message"]["content"] == []
        assert delta["delta"]["stop_reason"] == "max_tokens" and delta["usage"]["output_tokens"] == 4

    def test_max_tokens_is_cut_to_what_the_prompt_leaves(self, client):
        # Claude Code asks for 32000 whatever the model; chat would refuse this (context 8192).
        body = client.post(MESSAGES, json=ask(max_tokens=32000, stop_sequences=["."])).json()
        assert body["type"] == "message", body

    def test_stop_sequence(self, client):
        first = client.post(MESSAGES, json=ask("Count: 1, 2, 3, 4, 5", max_tokens=30)).json()
        text = first["content"][0]["text"]
        assert len(text) > 2, text
        stop = text[1:3]  # what the same greedy answer writes: it stops there
        body = client.post(MESSAGES, json=ask("Count: 1, 2, 3, 4, 5", max_tokens=30, stop_sequences=[stop])).json()
        assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", stop), body
        assert stop not in body["content"][0]["text"]

    def test_count_tokens_is_the_prompt_messages_generates_from(self, client):
        request = ask("Count my tokens.", system="Be brief.")
        counted = client.post(COUNT + "?beta=true", json={k: request[k] for k in ("model", "messages", "system")})
        assert counted.status_code == 200 and set(counted.json()) == {"input_tokens"}
        usage = client.post(MESSAGES, json=request).json()["usage"]
        assert counted.json()["input_tokens"] == usage["input_tokens"] + usage["cache_read_input_tokens"]


class TestErrors:
    def test_validation(self, client):
        missing = {k: v for k, v in ask().items() if k != "max_tokens"}
        assert "max_tokens" in assert_anthropic_error(client.post(MESSAGES, json=missing), 400, "invalid_request_error")
        bad = ask(messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}])
        assert_anthropic_error(client.post(MESSAGES, json=bad), 400, "invalid_request_error")
        assert_anthropic_error(client.post(MESSAGES, content=b"{", headers={"content-type": "application/json"}), 400, "invalid_request_error")  # fmt: skip
        assert_anthropic_error(client.post(COUNT, json={"model": "smollm2"}), 400, "invalid_request_error")

    def test_unknown_model_route_and_method(self, client):
        assert "`gpt-9`" in assert_anthropic_error(
            client.post(MESSAGES, json=ask(model="gpt-9")), 404, "not_found_error"
        )
        assert_anthropic_error(client.post(COUNT, json={**ask(model="gpt-9")}), 404, "not_found_error")
        assert_anthropic_error(client.post(MESSAGES + "/batches", json={}), 404, "not_found_error")
        assert_anthropic_error(client.get(MESSAGES), 405, "invalid_request_error")

    def test_image_on_a_text_model(self, client):
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
        request = ask(messages=[{"role": "user", "content": [image, {"type": "text", "text": "What is it?"}]}])
        message = assert_anthropic_error(client.post(MESSAGES, json=request), 400, "invalid_request_error")
        assert "messages.0.content.0" in message and "text only" in message

    @pytest.mark.parametrize("stream", [False, True])
    def test_a_prompt_over_the_context_has_the_text_claude_code_parses(self, client, stream):
        message = assert_anthropic_error(
            client.post(MESSAGES, json=ask("hi " * 9000, stream=stream)), 400, "invalid_request_error"
        )
        match = re.fullmatch(r"prompt is too long: (\d+) tokens > (\d+) maximum", message)
        assert match and int(match.group(1)) > 9000 and int(match.group(2)) == 8191, message

    def test_the_openai_routes_keep_their_shape(self, client):
        error = client.post("/v1/chat/completions", json={"messages": []}).json()["error"]
        assert set(error) == {"message", "type", "param", "code"}


class TestAuth:
    @pytest.mark.parametrize("headers", [{"x-api-key": "k1"}, {"Authorization": "Bearer k1"}])
    def test_either_header_carries_the_key(self, keyed, headers):
        assert keyed.post(MESSAGES, json=ask(), headers=headers).status_code == 200
        assert keyed.post(COUNT, json={"model": "smollm2", "messages": ask()["messages"]}, headers=headers).json()[
            "input_tokens"
        ]
        assert keyed.post("/v1/chat/completions", json={"messages": ask()["messages"], "max_tokens": 1}, headers=headers).status_code == 200  # fmt: skip

    @pytest.mark.parametrize(
        "headers", [{}, {"x-api-key": "wrong"}, {"x-api-key": ""}, {"Authorization": "Bearer wrong"}]
    )
    def test_a_missing_or_wrong_key_is_an_authentication_error(self, keyed, headers):
        assert_anthropic_error(keyed.post(MESSAGES, json=ask(), headers=headers), 401, "authentication_error")
        assert_anthropic_error(keyed.post(COUNT, json={}, headers=headers), 401, "authentication_error")


class TestPrefixReuse:
    """Claude Code's first system block is `x-anthropic-billing-header: cc_version=2.1.332.XYZ; ...`, XYZ a hash
    of the session's first prompt: two sessions differ there, at the head of the prompt."""

    def session(self, client, version: str, question: str) -> dict:
        system = [billing(version), {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
        return client.post(MESSAGES, json=ask(question, system=system, max_tokens=1)).json()["usage"]

    def test_a_new_sessions_billing_line_does_not_cost_the_cached_prefix(self, client):
        first = self.session(client, "18b", "What is 2+2?")
        second = self.session(client, "3fa", "What is the capital of France?")
        prompt = first["input_tokens"] + first["cache_read_input_tokens"]
        assert prompt > 400
        # all of the shared system prompt comes from the cache: only the new question is computed
        assert second["cache_read_input_tokens"] > prompt - 30, (first, second)

    def test_a_change_at_the_head_that_is_not_the_billing_line_does_cost_it(self, client):
        """The control: the same change, in a block that is not the billing line, is in the prompt."""
        system = [{"type": "text", "text": "Session 18b."}, {"type": "text", "text": SYSTEM}]
        client.post(MESSAGES, json=ask("What is 2+2?", system=system, max_tokens=1))
        system[0]["text"] = "Session 3fa."
        second = client.post(MESSAGES, json=ask("What is 2+2?", system=system, max_tokens=1)).json()["usage"]
        assert second["cache_read_input_tokens"] < 30, second
