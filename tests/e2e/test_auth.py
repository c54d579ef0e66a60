"""API keys on a real server: the openai client's key is checked; health stays open. (The keyed server is the
default model's, shared with the Deltafin gateway tests as their upstream: tests/conftest.py.)"""

import httpx
import openai
import pytest

from tests.app.test_http import assert_open_route_answered
from tests.conftest import API_KEYS, compose_config

pytestmark = pytest.mark.e2e


def client(server, key):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=60)


def test_wrong_key_is_authentication_error(keyed_server):
    with pytest.raises(openai.AuthenticationError) as info:
        client(keyed_server, "nope").models.list()
    assert info.value.status_code == 401 and info.value.body["type"] == "authentication_error"


@pytest.mark.parametrize("key", API_KEYS)
def test_any_configured_key_works(keyed_server, key):
    assert client(keyed_server, key).models.list().data[0].id == compose_config().model.name


def test_health_needs_no_key(keyed_server):
    assert_open_route_answered("/health", httpx.get(f"{keyed_server.base_url}/health"))


def test_non_ascii_key_is_401_not_500(keyed_server):
    response = httpx.get(f"{keyed_server.base_url}/v1/models", headers=[(b"authorization", b"Bearer \xc3\xa9\xff")])
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("path", ["/metrics", "/schema/openapi.json"])
def test_open_routes_need_no_key(keyed_server, path):
    assert_open_route_answered(path, httpx.get(f"{keyed_server.base_url}{path}"))


def test_unknown_paths_and_bodies_wait_for_the_key(keyed_server):
    assert httpx.get(f"{keyed_server.base_url}/nothing").status_code == 401
    response = httpx.post(f"{keyed_server.base_url}/v1/chat/completions", content=b"{not json")
    assert response.status_code == 401


def anthropic_client(server, **credentials):
    import anthropic

    return anthropic.Anthropic(base_url=server.base_url, max_retries=0, timeout=60, **credentials)


@pytest.mark.parametrize("credentials", [{"api_key": API_KEYS[0]}, {"auth_token": API_KEYS[-1]}])
def test_the_anthropic_sdk_authenticates_with_either_header(keyed_server, credentials):
    """`api_key` is sent as x-api-key, `auth_token` as Authorization: Bearer (Claude Code's two variables)."""
    model = compose_config().model.name
    counted = anthropic_client(keyed_server, **credentials).messages.count_tokens(
        model=model, messages=[{"role": "user", "content": "hi"}]
    )
    assert counted.input_tokens > 0


def test_the_anthropic_sdk_reads_a_wrong_key_as_authentication_error(keyed_server):
    import anthropic

    with pytest.raises(anthropic.AuthenticationError) as info:
        anthropic_client(keyed_server, api_key="nope").messages.create(
            model="any", max_tokens=1, messages=[{"role": "user", "content": "hi"}]
        )
    assert info.value.status_code == 401 and info.value.body["error"]["type"] == "authentication_error"
