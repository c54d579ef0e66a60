"""In-process HTTP tests: the Litestar app with the real engine, no network."""

import pytest
from litestar.testing import TestClient

from deltafin.app import build_app
from tests.conftest import compose_config

CHAT = "/v1/chat/completions"


def user(text="Say hello."):
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def client(config, services):
    with TestClient(build_app(config, services)) as client:
        yield client


def assert_openai_error(response, status, param=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


def assert_open_route_answered(path, response):
    """A 200 from one of the routes open without a key, with that route's own content (not an error page)."""
    assert response.status_code == 200, response.text
    if path == "/health":
        assert response.json()["status"] == "ok", response.text
    elif path == "/metrics":
        assert "# TYPE deltafin_requests" in response.text, response.text[:500]
    else:  # the OpenAPI document
        assert "/v1/chat/completions" in response.json()["paths"], response.text[:500]


def assert_models_listed(response):
    assert response.status_code == 200, response.text
    assert "smollm2" in [model["id"] for model in response.json()["data"]], response.text


class TestErrors:
    def test_malformed_json_is_400(self, client):
        response = client.post(CHAT, content=b"{bad", headers={"content-type": "application/json"})
        assert_openai_error(response, 400)

    @pytest.mark.parametrize(
        "body,param",
        [
            ({"messages": []}, "messages"),
            ({}, "messages"),
            ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
            ({"messages": user(), "temperature": "hot"}, "temperature"),
            ({"messages": user(), "max_tokens": -1}, "max_tokens"),
            ({"messages": user(), "n": 0}, "n"),
            ({"messages": user(), "top_p": 1.5}, "top_p"),
            ({"messages": user(), "n": 1000}, "n"),
            ({"messages": user(), "stop": [""]}, "stop"),
            ({"messages": [{"role": "user"}]}, "messages[0].content"),
            ({"messages": user(), "tool_choice": "sometimes"}, "tool_choice"),
            ({"messages": [{"role": "user", "content": [{"type": "video", "x": 1}]}]}, None),
        ],
    )
    def test_invalid_chat_requests_are_400_never_422(self, client, body, param):
        assert_openai_error(client.post(CHAT, json=body), 400, param)

    def test_completion_prompt_must_be_a_string(self, client):
        assert_openai_error(client.post("/v1/completions", json={"prompt": 42}), 400, "prompt")

    def test_unknown_model_is_404_model_not_found(self, client):
        error = assert_openai_error(client.post(CHAT, json={"messages": user(), "model": "gpt-9"}), 404, "model")
        assert error["code"] == "model_not_found"

    def test_unknown_route_is_404(self, client):
        assert_openai_error(client.get("/v1/nothing"), 404)

    def test_wrong_method_is_405(self, client):
        assert_openai_error(client.get(CHAT), 405)

    def test_body_over_the_limit_is_413(self, client, config):
        big = "x" * (config.server.max_body_bytes + 10)
        assert_openai_error(client.post(CHAT, json={"messages": user(big)}), 413)

    def test_prompt_over_the_context_is_400_with_openai_wording(self, client, config):
        text = "hello " * 9000
        error = assert_openai_error(client.post(CHAT, json={"messages": user(text)}), 400)
        assert error["message"].startswith(
            "This model's maximum context length is 8192 tokens. However, your request has"
        )
        assert error["code"] == "context_length_exceeded"

    def test_prompt_plus_max_tokens_over_the_context_is_400(self, client):
        error = assert_openai_error(client.post(CHAT, json={"messages": user(), "max_tokens": 9000}), 400)
        assert "maximum context length is 8192 tokens" in error["message"] and "you requested" in error["message"]

    def test_images_on_a_text_model_are_400(self, client):
        content = [{"type": "image_url", "image_url": {"url": "http://x/cat.png"}}]
        assert_openai_error(client.post(CHAT, json={"messages": [{"role": "user", "content": content}]}), 400)


class TestHostileInputs:
    """Inputs that reach the sampler or the matcher: an answer or a 400, never a 500."""

    @pytest.mark.parametrize(
        "extra,status",
        [
            ({"temperature": 1e-30}, 200),
            ({"seed": 2**63 - 1, "n": 2, "temperature": 1.0}, 200),
            ({"seed": -(2**63)}, 200),
            ({"seed": 2**70}, 400),
            ({"stop": ["x" * 2000]}, 400),
            ({"top_k": 10**9, "temperature": 1.0}, 200),
            ({"min_p": 1.0, "top_p": 1e-9, "temperature": 2.0}, 200),
            ({"logit_bias": {str(i): -100 for i in range(50)}, "temperature": 1.0}, 200),
            ({"max_tokens": 2**62}, 400),
            ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, 400),
            ({"messages": [{"role": "user", "content": "x" * 100, "tool_calls": [{"function": {}}]}]}, 400),
        ],
    )
    def test_no_500(self, client, extra, status):
        body = {"messages": user(), "max_tokens": 3, **extra}
        response = client.post(CHAT, json=body)
        assert response.status_code == status, response.text


class TestHeaders:
    def test_request_id_is_generated(self, client):
        assert len(client.get("/v1/models").headers["x-request-id"]) >= 16

    def test_request_id_is_echoed(self, client):
        assert client.get("/v1/models", headers={"x-request-id": "abc-123"}).headers["x-request-id"] == "abc-123"

    def test_request_id_on_errors_too(self, client):
        assert client.get("/nope", headers={"x-request-id": "r1"}).headers["x-request-id"] == "r1"


class TestEndpoints:
    def test_health_is_ok_once_loaded(self, client):
        assert client.get("/health").json()["status"] == "ok"

    def test_models_lists_the_served_name_and_aliases(self, client, config):
        ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
        assert ids == [config.model.name, *config.model.aliases]

    def test_alias_is_accepted_as_model(self, client):
        response = client.post(CHAT, json={"messages": user(), "model": "smollm2", "max_tokens": 2})
        assert response.status_code == 200 and response.json()["model"] == "SmolLM2-135M-Instruct"

    def test_openapi_schema_is_served(self, client):
        paths = client.get("/schema/openapi.json").json()["paths"]
        assert "/v1/chat/completions" in paths and "/tokenize" in paths

    def test_metrics_count_requests(self, client):
        client.get("/v1/models")
        body = client.get("/metrics").text
        assert 'deltafin_requests_total{route="/v1/models",status="200"}' in body

    def test_tokenize_and_detokenize_round_trip(self, client):
        tokens = client.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
        assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 8192
        assert tokens["token_strs"][1] == "Ġworld"
        assert client.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == "Hello world"

    def test_tokenize_messages_matches_the_chat_prompt(self, client):
        messages = user("What is 2+2?")
        tokenized = client.post("/tokenize", json={"messages": messages}).json()
        chat = client.post(CHAT, json={"messages": messages, "max_tokens": 1}).json()
        assert tokenized["count"] == chat["usage"]["prompt_tokens"]

    def test_detokenize_rejects_ids_outside_the_vocabulary(self, client):
        assert_openai_error(client.post("/detokenize", json={"tokens": [10**7]}), 400, "tokens[0]")


@pytest.fixture(scope="module")
def keyed(services):
    config = compose_config(["server.api_keys=[sekrit]"])
    with TestClient(build_app(config, services)) as client:
        yield client


class TestApiKeys:
    def test_missing_key_is_401(self, keyed):
        assert_openai_error(keyed.get("/v1/models"), 401)

    def test_wrong_key_is_401(self, keyed):
        assert_openai_error(keyed.get("/v1/models", headers={"authorization": "Bearer nope"}), 401)

    def test_right_key_passes(self, keyed):
        assert_models_listed(keyed.get("/v1/models", headers={"authorization": "Bearer sekrit"}))

    def test_health_needs_no_key(self, keyed):
        assert_open_route_answered("/health", keyed.get("/health"))


class TestLoading:
    def test_a_failed_load_is_reported_not_hidden(self, config, monkeypatch):
        from deltafin.app.services import Services

        def broken(cls, cfg, store=None):
            raise RuntimeError("safetensors header is corrupt")

        monkeypatch.setattr(Services, "load", classmethod(broken))
        with TestClient(build_app(config)) as client:
            import time

            for _ in range(50):
                health = client.get("/health")
                if health.json()["status"] == "failed":
                    break
                time.sleep(0.05)
            assert health.status_code == 503 and "corrupt" in health.json()["error"]
            error = assert_openai_error(client.post(CHAT, json={"messages": user()}), 503)
            assert error["code"] == "model_load_failed"

    def test_health_and_endpoints_are_503_while_loading(self, config, monkeypatch):
        import threading

        from deltafin.app.services import Services

        release = threading.Event()
        monkeypatch.setattr(Services, "load", classmethod(lambda cls, cfg, store=None: release.wait(30) and None))
        with TestClient(build_app(config)) as client:
            assert client.get("/health").status_code == 503
            response = client.post(CHAT, json={"messages": user()})
            assert_openai_error(response, 503)
            assert response.headers["retry-after"]
            release.set()
