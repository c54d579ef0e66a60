"""API keys on a real server: the openai client's key is checked; health stays open."""

import httpx
import openai
import pytest

from tests.conftest import LiveServer

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def keyed_server(tiny_models):
    server = LiveServer(["model=glm", "model.variant=glm47", f"model.path={tiny_models['glm47']}", "server.api_keys=[k1,k2]"])
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def client(server, key):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=60)


def test_wrong_key_is_authentication_error(keyed_server):
    with pytest.raises(openai.AuthenticationError) as info:
        client(keyed_server, "nope").models.list()
    assert info.value.status_code == 401 and info.value.body["type"] == "authentication_error"


@pytest.mark.parametrize("key", ["k1", "k2"])
def test_any_configured_key_works(keyed_server, key):
    assert client(keyed_server, key).models.list().data[0].id == "glm"


def test_health_needs_no_key(keyed_server):
    assert httpx.get(f"{keyed_server.base_url}/health").status_code == 200
