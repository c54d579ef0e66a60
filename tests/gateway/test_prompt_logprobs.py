"""Prompt logprobs cannot come from an upstream: `echo` with `logprobs` is a 400 naming `echo`, not a silent gap."""

from __future__ import annotations

import pytest
from litestar.testing import TestClient

from deltafin.app.factory import build_app
from deltafin.app.services import Services
from deltafin.engine import EngineFront
from deltafin.engine.upstream.llama_server import LlamaServerAdapter
from deltafin.testing.upstream_fakes import Fake, ScriptedBody, make_engine
from tests.conftest import compose_config

EVENTS = [
    {"content": "x", "tokens": [28], "stop": False},
    {"content": "", "tokens": [], "stop": True, "stop_type": "limit", "tokens_evaluated": 2, "timings": {"cache_n": 0}},
]


@pytest.fixture(scope="module")
def gateway(bundle):
    config = compose_config(["server.memo.entries=0"])
    fake = Fake(lambda body, path: ScriptedBody(EVENTS, tail=b""))
    front = EngineFront(make_engine(LlamaServerAdapter, bundle, fake), max_waiting=4, timeout_s=5, memo_entries=0)
    with TestClient(build_app(config, Services.from_engine(config, front))) as client:
        yield client, fake


@pytest.mark.parametrize("logprobs", [0, 2])
@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_is_a_400_naming_echo(gateway, logprobs, stream):
    client, fake = gateway
    sent = len(fake.requests)
    response = client.post(
        "/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "echo": True, "logprobs": logprobs, "stream": stream}
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "echo" and error["type"] == "invalid_request_error"
    assert "llama_server" in error["message"] and "logprobs" in error["message"]
    assert len(fake.requests) == sent  # refused before anything went upstream


def test_echo_alone_and_logprobs_alone_still_work(gateway):
    client, fake = gateway
    sent = len(fake.requests)
    echoed = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "echo": True})
    assert echoed.status_code == 200 and echoed.json()["choices"][0]["text"].startswith("Hi")
    scored = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "logprobs": 1})
    assert scored.status_code == 200 and len(fake.requests) == sent + 2
