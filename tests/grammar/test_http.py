"""In-process HTTP: response_format validation, tools refused on a model with no tool parser, constraints an
engine cannot enforce, and the 404 that says what Deltafin serves."""

from __future__ import annotations

import pytest
from litestar.testing import TestClient

from deltafin.app import build_app
from deltafin.engine.interface import EngineCapabilities
from deltafin.grammar.failures import WorkerLost
from tests.app.test_http import CHAT, assert_openai_error, user

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}


class _NoGrammar:
    """The real engine, claiming it cannot constrain (as an upstream without structured outputs)."""

    capabilities = EngineCapabilities(grammar=False)

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)


@pytest.fixture(scope="module")
def client(config, services):
    with TestClient(build_app(config, services)) as client:
        yield client


class TestResponseFormatValidation:
    @pytest.mark.parametrize(
        "response_format,param",
        [
            ({"type": "bogus"}, "response_format.type"),
            ({"type": "json_schema"}, "response_format.json_schema"),
            ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema"),
            (
                {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}},
                "response_format.json_schema.schema",
            ),
        ],
    )
    def test_400_naming_the_field(self, client, response_format, param):
        response = client.post(CHAT, json={"messages": user(), "response_format": response_format, "max_tokens": 1})
        assert_openai_error(response, 400, param)

    def test_text_is_plain_generation(self, client):
        response = client.post(CHAT, json={"messages": user(), "response_format": {"type": "text"}, "max_tokens": 1})
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "length" and response.json()["usage"]["completion_tokens"] == 1, choice

    def test_an_engine_without_constrained_decoding_refuses_instead_of_ignoring(self, client, services, monkeypatch):
        monkeypatch.setattr(services.ctx.engine, "client", _NoGrammar(services.ctx.engine.client))
        response = client.post(
            CHAT, json={"messages": user(), "response_format": {"type": "json_object"}, "max_tokens": 1}
        )
        assert_openai_error(response, 400, "response_format")

    def test_a_grammar_worker_lost_is_a_retryable_503_not_a_400(self, client, services, monkeypatch):
        """Killed from outside (the OOM killer, an operator): the server's failure, so 503 with Retry-After, which
        clients retry, not the 400 that says the schema cannot be enforced (tests/grammar/test_service.py kills a
        real worker)."""

        async def lost(constraint, **kwargs):
            raise WorkerLost("the grammar worker was lost while compiling it")

        monkeypatch.setattr(services.ctx.grammars, "prepare", lost)
        response = client.post(
            CHAT, json={"messages": user(), "response_format": {"type": "json_object"}, "max_tokens": 1}
        )
        error = assert_openai_error(response, 503)
        assert error["code"] == "grammar_worker_lost" and response.headers["retry-after"] == "1"


class TestTools:
    def test_tools_to_a_model_without_a_tool_parser_is_400(self, client):
        response = client.post(CHAT, json={"messages": user(), "tools": [WEATHER], "max_tokens": 1})
        error = assert_openai_error(response, 400, "tools")
        assert "tool" in error["message"]

    def test_a_forced_tool_choice_without_tools_is_400(self, client):
        response = client.post(CHAT, json={"messages": user(), "tool_choice": "required", "max_tokens": 1})
        assert_openai_error(response, 400, "tool_choice")

    def test_tool_choice_none_keeps_tools_harmless(self, client):
        response = client.post(
            CHAT, json={"messages": user(), "tools": [WEATHER], "tool_choice": "none", "max_tokens": 1}
        )
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        # one token of plain text: no tool call was forced or parsed out of it
        assert choice["finish_reason"] == "length" and not choice["message"].get("tool_calls"), choice


class TestUnservedRoutes:
    @pytest.mark.parametrize(
        "method,path", [("post", "/v1/embeddings"), ("post", "/v1/audio/transcriptions"), ("get", "/v1/nothing")]
    )
    def test_404_says_what_is_served(self, client, method, path):
        error = assert_openai_error(
            getattr(client, method)(path, json={}) if method == "post" else client.get(path), 404
        )
        assert path in error["message"] and "/v1/chat/completions" in error["message"]
        assert "/v1/responses" in error["message"] and error["code"] == "route_not_found"
