"""Several models in one process (`+models.NAME=[...]`): the app loads each in turn, a request's `model` chooses,
and one model failing or still loading costs the others nothing. In process, with the real default model (its
weights shared by the two engines: the requests here never overlap)."""

from __future__ import annotations

import threading
import time

import pytest
import structlog
from litestar.testing import TestClient

from deltafin.app import build_app
from deltafin.app.services import Services
from tests.conftest import compose_config, make_engine

MAIN = compose_config()
OTHER = compose_config(["model.name=other", "model.aliases=[claude-*]", "server.memo.entries=0"])
CHAT = "/v1/chat/completions"


def chat(name: str | None) -> dict:
    body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 3}
    return body if name is None else {**body, "model": name}


def wait_for(client: TestClient, status: str) -> dict:
    """/health once it says `status` and no model is still loading."""
    for _ in range(400):
        health = client.get("/health").json()
        if health["status"] == status and "loading" not in health.get("models", {}).values():
            return health
        time.sleep(0.05)
    raise AssertionError(f"/health never said {status}: {health}")


def loader(
    loaded_model,
    fail: str | None = None,
    gate: threading.Event | None = None,
    error: str = "safetensors header is corrupt",
):
    """Services.load as the app calls it (config, shared store), on the session's loaded weights."""

    def load(cls, config, store=None):
        if config.model.name == fail:
            raise RuntimeError(error)
        if gate is not None and config.model.name == OTHER.model.name:
            gate.wait(60)
        return Services.from_engine(config, make_engine(loaded_model), store)

    return classmethod(load)


@pytest.fixture(scope="module")
def client(loaded_model):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Services, "load", loader(loaded_model))
        with TestClient(build_app(MAIN, models=[OTHER])) as client:
            wait_for(client, "ok")
            yield client


class TestRouting:
    def test_the_model_field_chooses_and_no_model_is_the_main_one(self, client):
        assert client.post(CHAT, json=chat("other")).json()["model"] == "other"
        assert client.post(CHAT, json=chat(None)).json()["model"] == MAIN.model.name
        assert client.post(CHAT, json=chat("smollm2")).json()["model"] == MAIN.model.name  # its alias

    def test_an_unknown_model_is_404_naming_the_served_ones(self, client):
        response = client.post(CHAT, json=chat("gpt-4"))
        error = response.json()["error"]
        assert response.status_code == 404 and error["code"] == "model_not_found" and error["param"] == "model"
        assert f"`{MAIN.model.name}`, `other`" in error["message"]

    @pytest.mark.parametrize("path", [CHAT, "/tokenize"])
    def test_a_huge_unknown_name_is_quoted_cut(self, client, path):
        response = client.post(path, json={**chat("x" * 1_000_000), "prompt": "hi"})
        assert response.status_code == 404 and len(response.content) < 1000
        assert client.get("/v1/models/" + "y" * 10_000).status_code in (404, 414)

    def test_models_lists_every_model_and_describes_each(self, client):
        assert [card["id"] for card in client.get("/v1/models").json()["data"]] == [MAIN.model.name, "smollm2", "other"]
        assert client.get("/v1/models/other").json()["root"] == "other"
        assert client.get("/v1/models/nope").status_code == 404

    def test_an_alias_pattern_catches_the_names_it_matches(self, client):
        """`claude-*` (what Claude Code sends unless told a model) reaches `other`, on every route; it is not a
        model of its own in the list, and exact names still win."""
        assert client.post(CHAT, json=chat("claude-opus-5-5")).json()["model"] == "other"
        message = {"model": "claude-sonnet-4-5", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
        assert client.post("/v1/messages", json=message).json()["model"] == "claude-sonnet-4-5"  # echoed, as sent
        assert client.get("/v1/models/claude-x").json()["root"] == "other"
        assert "claude-*" not in [card["id"] for card in client.get("/v1/models").json()["data"]]
        assert client.post(CHAT, json=chat("claude")).status_code == 404  # `claude-*` needs the dash

    def test_tokenize_and_parse_take_the_model_too(self, client):
        assert client.post("/tokenize", json={"model": "other", "prompt": "hi"}).json()["count"] >= 1
        assert client.post("/tokenize", json={"model": "nope", "prompt": "hi"}).status_code == 404
        assert client.post("/parse", json={"model": "other", "text": "hi"}).status_code == 200

    def test_a_stored_response_is_found_whichever_model_answered(self, client):
        created = client.post("/v1/responses", json={"model": "other", "input": "Hi.", "max_output_tokens": 3})
        assert created.status_code == 200, created.text
        stored = client.get(f"/v1/responses/{created.json()['id']}")
        assert stored.status_code == 200 and stored.json()["model"] == "other"

    def test_metrics_are_labelled_by_the_model_that_answered(self, client):
        client.post(CHAT, json=chat("other"))
        client.post(CHAT, json=chat(None))
        client.post(CHAT, json=chat("gpt-4-" + "x" * 50))  # a 404: no series of its own
        body = client.get("/metrics").text
        for model in (MAIN.model.name, "other"):
            assert f'deltafin_completion_tokens_total{{model="{model}"}}' in body
            assert f'deltafin_queue_depth{{model="{model}"}} 0.0' in body
            assert f'deltafin_time_to_first_token_seconds_count{{model="{model}"}}' in body
        assert "gpt-4" not in body

    def test_health_names_each_models_status(self, client):
        health = client.get("/health").json()
        assert health["status"] == "ok" and health["model"] == MAIN.model.name
        assert health["models"] == {MAIN.model.name: "ok", "other": "ok"}


def test_a_model_that_fails_to_load_costs_the_others_nothing(loaded_model, monkeypatch):
    monkeypatch.setattr(Services, "load", loader(loaded_model, fail="other"))
    with TestClient(build_app(MAIN, models=[OTHER])) as client:
        health = wait_for(client, "failed")
        assert client.get("/health").status_code == 503
        assert health["failing_model"] == "other" and "corrupt" in health["error"]
        assert health["models"] == {MAIN.model.name: "ok", "other": "failed"}
        refused = client.post(CHAT, json=chat("other"))
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "model_load_failed"
        assert "`other` failed to load" in refused.json()["error"]["message"]
        assert client.post(CHAT, json=chat(None)).status_code == 200
        assert [card["id"] for card in client.get("/v1/models").json()["data"]] == [MAIN.model.name, "smollm2"]


def test_when_the_main_model_fails_the_others_still_list_and_store(loaded_model, monkeypatch):
    # a message whose first line is empty (multiprocessing's start-up errors are) still marks the model failed
    monkeypatch.setattr(Services, "load", loader(loaded_model, fail=MAIN.model.name, error="\n  header is corrupt."))
    with TestClient(build_app(MAIN, models=[OTHER])) as client:
        health = wait_for(client, "failed")
        assert health["failing_model"] == MAIN.model.name and health["error"] == "header is corrupt."
        refused = client.post(CHAT, json=chat(None))
        assert refused.status_code == 503
        assert refused.json()["error"]["message"].endswith(f"`{MAIN.model.name}` failed to load: header is corrupt.")
        assert [card["id"] for card in client.get("/v1/models").json()["data"]] == ["other"]
        created = client.post("/v1/responses", json={"model": "other", "input": "Hi.", "max_output_tokens": 3})
        stored = client.get(f"/v1/responses/{created.json()['id']}")
        assert stored.status_code == 200 and stored.json()["model"] == "other"
        assert client.delete(f"/v1/responses/{created.json()['id']}").status_code == 200


def test_ready_is_logged_once_every_model_is_loaded(loaded_model, monkeypatch):
    monkeypatch.setattr(Services, "load", loader(loaded_model))
    with structlog.testing.capture_logs() as logs:
        with TestClient(build_app(MAIN, models=[OTHER])) as client:
            wait_for(client, "ok")
            for _ in range(200):
                if any(log["event"] == "ready" for log in logs):
                    break
                time.sleep(0.05)
    (ready,) = [log for log in logs if log["event"] == "ready"]
    assert ready["models"] == [MAIN.model.name, "other"]


def test_the_main_model_serves_while_the_next_one_loads(loaded_model, monkeypatch):
    gate = threading.Event()
    monkeypatch.setattr(Services, "load", loader(loaded_model, gate=gate))
    with TestClient(build_app(MAIN, models=[OTHER])) as client:
        for _ in range(400):
            if client.post(CHAT, json=chat(None)).status_code == 200:
                break
            time.sleep(0.05)
        loading = client.post(CHAT, json=chat("other"))
        assert loading.status_code == 503 and loading.headers["retry-after"]
        assert "`other` is still loading" in loading.json()["error"]["message"]
        health = client.get("/health").json()
        assert health["models"] == {MAIN.model.name: "ok", "other": "loading"} and health["failing_model"] == "other"
        gate.set()
        wait_for(client, "ok")
        assert client.post(CHAT, json=chat("other")).status_code == 200
