"""The generation routes (deltafin.app.generation: Litestar `@asgi` handlers, which leave methods, the body limit
and /schema to the handler) answer as Litestar's HTTP routes do: method and path handling, body limits, error
bodies, metrics labels and /schema."""

import asyncio

import pytest
from litestar.testing import TestClient

from deltafin.app import build_app
from deltafin.app.generation import GENERATION_ROUTES, read_body
from deltafin.errors import ClientClosedRequest, InvalidRequestError, PayloadTooLargeError
from tests.app.test_http import assert_openai_error, user

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def client(config, services):
    with TestClient(build_app(config, services)) as client:
        yield client


class TestMethodsAndPaths:
    @pytest.mark.parametrize("path", list(GENERATION_ROUTES))
    def test_options_lists_post(self, client, path):
        response = client.options(path)
        assert response.status_code == 204 and set(response.headers["allow"].split(", ")) == {"POST", "OPTIONS"}

    @pytest.mark.parametrize("method", ["GET", "PUT", "DELETE", "PATCH"])
    def test_other_methods_are_405_with_allow(self, client, method):
        response = client.request(method, CHAT)
        assert_openai_error(response, 405)
        assert "POST" in response.headers["allow"]

    @pytest.mark.parametrize("path", ["/v1/chat/completions/", "//v1/chat/completions", "/v1//chat/completions//"])
    def test_paths_are_matched_as_litestar_normalises_them(self, client, path):
        response = client.post(path, json={"messages": user(), "max_tokens": 2, "temperature": 0})
        assert response.status_code == 200 and response.json()["object"] == "chat.completion"

    def test_unversioned_completions_alias(self, client):
        response = client.post("/completions", json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
        assert response.status_code == 200 and response.json()["object"] == "text_completion"

    def test_other_routes_still_reach_litestar(self, client):
        assert client.get("/v1/models").status_code == 200
        assert_openai_error(client.post("/v1/chat/completion", json={}), 404)

    def test_metrics_label_the_route_by_its_path(self, client):
        client.post("/chat/completions", json={"messages": user(), "max_tokens": 1, "temperature": 0})
        client.post(CHAT, json={"messages": "not a list"})
        body = client.get("/metrics").text
        assert 'deltafin_requests_total{route="/chat/completions",status="200"}' in body
        assert 'deltafin_requests_total{route="/v1/chat/completions",status="400"}' in body


class TestResponses:
    def test_json_answer_has_its_length_and_type(self, client):
        response = client.post(CHAT, json={"messages": user(), "max_tokens": 2, "temperature": 0})
        assert response.headers["content-type"] == "application/json"
        assert int(response.headers["content-length"]) == len(response.content)

    def test_stream_answer_is_event_stream(self, client):
        body = {"messages": user(), "max_tokens": 2, "temperature": 0, "stream": True}
        with client.stream("POST", CHAT, json=body) as response:
            lines = [line for line in response.iter_lines() if line]
        assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
        assert response.headers["cache-control"] == "no-cache"
        assert lines[0].startswith('data: {"id":"chatcmpl-') and lines[-1] == "data: [DONE]"

    def test_schema_documents_both_routes_and_both_answers(self, client):
        paths = client.get("/schema/openapi.json").json()["paths"]
        for path, route in GENERATION_ROUTES.items():
            post = paths[path]["post"]
            ref = post["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            assert ref == f"#/components/schemas/{route.request_type.__name__}"
            assert set(post["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
        ids = [paths[p]["post"]["operationId"] for p in GENERATION_ROUTES]
        assert len(set(ids)) == len(ids)


def _receive(*messages):
    queue = list(messages)

    async def receive():
        return queue.pop(0)

    return receive


def _scope(headers=()):
    return {"type": "http", "headers": list(headers)}


class TestReadBody:
    def run(self, *messages, headers=(), limit=10):
        return asyncio.run(read_body(_scope(headers), _receive(*messages), limit))

    def test_parts_are_joined(self):
        body = self.run(
            {"type": "http.request", "body": b"ab", "more_body": True}, {"type": "http.request", "body": b"cd"}
        )
        assert body == b"abcd"

    def test_declared_length_over_the_limit_is_refused_before_reading(self):
        with pytest.raises(PayloadTooLargeError):
            self.run(headers=[(b"content-length", b"11")])  # no message to receive: it must not try

    def test_streamed_body_over_the_limit_is_refused(self):
        with pytest.raises(PayloadTooLargeError):
            self.run(
                {"type": "http.request", "body": b"x" * 6, "more_body": True},
                {"type": "http.request", "body": b"x" * 6, "more_body": True},
            )

    def test_a_bad_content_length_is_400(self):
        with pytest.raises(InvalidRequestError, match="content-length"):
            self.run(headers=[(b"content-length", b"ten")])

    def test_a_client_gone_mid_body_is_not_an_error_response(self):
        with pytest.raises(ClientClosedRequest):
            self.run({"type": "http.request", "body": b"ab", "more_body": True}, {"type": "http.disconnect"})


def test_chunked_upload_over_the_limit_is_413(client, config):
    def chunks():
        for _ in range(config.server.max_body_bytes // 65536 + 2):
            yield b"x" * 65536

    response = client.post(CHAT, content=chunks(), headers={"content-type": "application/json"})
    assert_openai_error(response, 413)
