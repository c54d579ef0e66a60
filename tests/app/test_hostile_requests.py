"""Single requests that could cost a 500 (or a CPU burn): each is a 400 naming its field."""

import time

import pytest
from litestar.testing import TestClient

from deltafin.app import build_app
from deltafin.app.services import Services
from tests.app.test_http import assert_openai_error, user
from tests.conftest import compose_config, make_engine

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def trusting_client(loaded_model):
    """A server whose operator trusts request templates: the render budget is what protects it."""
    config = compose_config(
        ["server.templates.trust_request_chat_template=true", "server.templates.render_timeout_s=0.5"]
    )
    services = Services.from_engine(config, make_engine(loaded_model))
    with TestClient(build_app(config, services)) as client:
        yield client


class TestEmptyPrompt:
    @pytest.mark.parametrize("stream", [False, True])
    def test_empty_completion_prompt_is_400(self, client, stream):
        response = client.post(COMPLETIONS, json={"prompt": "", "max_tokens": 1, "stream": stream})
        assert_openai_error(response, 400, "prompt")

    def test_template_rendering_nothing_is_400(self, trusting_client):
        body = {"messages": user(), "max_tokens": 1, "chat_template_kwargs": {"chat_template": ""}}
        assert_openai_error(trusting_client.post(CHAT, json=body), 400, "messages")


class TestBodyDecoding:
    def test_deeply_nested_body_is_400(self, client):
        deep = (
            b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"a": '
            + b"[" * 1000
            + b"]" * 1000
            + b"}}"
        )
        assert_openai_error(client.post(CHAT, content=deep, headers={"content-type": "application/json"}), 400)

    @pytest.mark.parametrize(
        "field,value",
        [("max_tokens", "2"), ("stream", "true"), ("n", 1.0), ("temperature", "0"), ("logprobs", 1)],
    )
    def test_no_silent_type_coercion(self, client, field, value):
        assert_openai_error(client.post(CHAT, json={"messages": user(), field: value}), 400, field)

    def test_nested_field_errors_name_their_path(self, client):
        body = {"messages": [{"role": "user", "content": "x"}, {"role": "wizard", "content": "y"}]}
        assert_openai_error(client.post(CHAT, json=body), 400, "messages[1].role")

    def test_repetition_penalty_near_zero_is_400(self, client):
        body = {"messages": user(), "repetition_penalty": 1e-300, "temperature": 1.0, "max_tokens": 2}
        assert_openai_error(client.post(CHAT, json=body), 400, "repetition_penalty")

    def test_smallest_allowed_repetition_penalty_samples(self, client):
        body = {"prompt": "Hello", "repetition_penalty": 0.01, "temperature": 1.0, "seed": 1, "max_tokens": 2}
        response = client.post(COMPLETIONS, json=body)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 2 and response.json()["choices"][0]["text"], (
            response.text
        )

    def test_body_schema_is_published(self, client):
        schema = client.get("/schema/openapi.json").json()
        chat = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
        assert chat["schema"]["$ref"] == "#/components/schemas/ChatCompletionRequest"
        properties = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
        assert {"messages", "max_tokens", "tools"} <= set(properties)


class TestRequestTemplates:
    def test_request_template_is_refused_by_default(self, client):
        body = {"messages": user(), "max_tokens": 1, "chat_template_kwargs": {"chat_template": "{{ 'x' }}"}}
        error = assert_openai_error(client.post(CHAT, json=body), 400, "chat_template_kwargs.chat_template")
        assert "trust_request_chat_template" in error["message"]

    def test_tokenize_refuses_it_too(self, client):
        body = {"messages": user(), "chat_template_kwargs": {"chat_template": "{{ 'x' }}"}}
        assert_openai_error(client.post("/tokenize", json=body), 400, "chat_template_kwargs.chat_template")

    def test_trusted_request_template_is_used(self, trusting_client):
        body = {"messages": user("abc"), "chat_template_kwargs": {"chat_template": "[{{ messages[0].content }}]"}}
        response = trusting_client.post("/tokenize", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["count"] >= 3

    @pytest.mark.parametrize(
        "template",
        [
            "{% for i in range(10**8) %}x{% endfor %}",  # jinja's sandbox refuses the range: OverflowError
            "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",  # CPU burn
            "{{ 'x' * 10**10 }}",  # one C-level allocation the watchdog could not interrupt
            "{% for i in range(99999) %}{{ 'y' * 999 }}{% endfor %}",  # 100 MB of output
        ],
    )
    def test_hostile_template_is_400_within_the_budget(self, trusting_client, template):
        body = {"messages": user(), "max_tokens": 1, "chat_template_kwargs": {"chat_template": template}}
        started = time.monotonic()
        assert_openai_error(trusting_client.post(CHAT, json=body), 400, "chat_template")
        # Generous: the render budget is 0.5 s; ten times it allows for a loaded machine, while a render left to run
        # (99999 loops of output) would take minutes.
        assert time.monotonic() - started < 5
        # The prompt thread is free again: a normal request is served.
        assert trusting_client.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 1}).status_code == 200

    def test_a_request_template_never_renders_on_the_event_loop(self, trusting_client):
        """Small bodies render on the loop, but a request's own template is code of unknown cost: it renders on
        a prompt thread, so a CPU burn (cut at the 0.5 s budget) leaves other clients answered meanwhile."""
        import threading

        burn = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
        body = {"messages": user(), "max_tokens": 1, "chat_template_kwargs": {"chat_template": burn}}
        statuses = []
        thread = threading.Thread(target=lambda: statuses.append(trusting_client.post(CHAT, json=body).status_code))
        thread.start()
        time.sleep(0.1)  # the burn is rendering
        models = trusting_client.get("/v1/models")
        # Event order: /v1/models was answered while the burn still rendered (it has no answer yet). On the event
        # loop, the burn would hold every other request until its budget cut it, and answer first.
        burn_still_running = statuses == []
        thread.join(10)
        assert models.status_code == 200 and [m["id"] for m in models.json()["data"]], models.text
        assert burn_still_running and statuses == [400], statuses
