"""streaming_error_preflight in process: an engine that fails at prefill, with and without the rule."""

import json

import pytest
from litestar.testing import TestClient

from deltafin.app import build_app
from deltafin.app.services import Services
from tests.conftest import compose_config, make_engine

BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}


def failing_client(loaded_model, overrides):
    config = compose_config(overrides)
    engine = make_engine(loaded_model)

    def broken(submission, choices):
        raise RuntimeError("CUDA error: device-side assert triggered")

    engine.client._admit_group = broken  # fails at prefill, as a broken device would
    return TestClient(build_app(config, Services.from_engine(config, engine)))


class TestStreamingErrorPreflight:
    def test_without_the_rule_the_error_arrives_inside_a_200_stream(self, loaded_model):
        with failing_client(loaded_model, []) as client:
            response = client.post("/v1/chat/completions", json=BODY)
            assert response.status_code == 200
            events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
            assert json.loads(events[-1])["error"]["type"] == "internal_error"
            assert "[DONE]" not in events

    def test_with_the_rule_the_error_is_a_real_http_status(self, loaded_model):
        with failing_client(loaded_model, ["compat=para"]) as client:
            response = client.post("/v1/chat/completions", json=BODY)
            assert response.status_code == 500
            assert response.json()["error"]["type"] == "internal_error"
            assert "CUDA" not in response.text  # the cause is logged, not sent
            assert "streaming_error_preflight" in response.headers["x-deltafin-rules"]

    def test_the_engine_is_free_after_the_failure(self, loaded_model):
        with failing_client(loaded_model, ["compat=para"]) as client:
            for _ in range(3):  # a leaked slot would turn the later ones into 429s
                assert client.post("/v1/chat/completions", json=BODY).status_code == 500

    @pytest.mark.parametrize("overrides", [[], ["compat=para"]])
    def test_non_streamed_failure_is_500_with_openai_body(self, loaded_model, overrides):
        with failing_client(loaded_model, overrides) as client:
            response = client.post("/v1/chat/completions", json={**BODY, "stream": False})
            assert response.status_code == 500 and set(response.json()["error"]) == {"message", "type", "param", "code"}
