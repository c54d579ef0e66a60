"""Who may call what, and what a request can put into responses, logs and metrics."""

import re

import pytest
from litestar.testing import TestClient

from deltafin.app import build_app
from deltafin.app.auth import is_open, key_matches
from tests.app.test_http import assert_models_listed, assert_open_route_answered, assert_openai_error
from tests.conftest import compose_config

CHAT = "/v1/chat/completions"


def keyed_client(services, open_routes):
    config = compose_config(["server.api_keys=[k1,k2]", f"server.open_routes={open_routes}"])
    return TestClient(build_app(config, services))


class TestApiKeys:
    @pytest.fixture(scope="class")
    @classmethod
    def keyed(cls, services):
        with keyed_client(services, "[/health,/metrics,/schema]") as client:
            yield client

    def test_non_ascii_bearer_is_401(self, keyed):
        response = keyed.get("/v1/models", headers=[(b"authorization", b"Bearer \xff\xfe")])
        assert_openai_error(response, 401)

    def test_key_is_checked_before_the_body_is_parsed(self, keyed):
        # Malformed JSON without a key: the answer is about the key, not the body.
        response = keyed.post(CHAT, content=b"{bad", headers={"content-type": "application/json"})
        assert_openai_error(response, 401)

    def test_valid_key_passes(self, keyed):
        assert_models_listed(keyed.get("/v1/models", headers={"authorization": "Bearer k2"}))

    @pytest.mark.parametrize("path", ["/health", "/metrics", "/schema/openapi.json"])
    def test_open_routes_need_no_key(self, keyed, path):
        assert_open_route_answered(path, keyed.get(path))

    def test_unknown_paths_need_the_key(self, keyed):
        assert_openai_error(keyed.get("/nothing/here"), 401)

    def test_closing_schema_and_metrics(self, services):
        with keyed_client(services, "[/health]") as closed:
            assert_openai_error(closed.get("/schema/openapi.json"), 401)
            assert_openai_error(closed.get("/metrics"), 401)
            assert closed.get("/health").status_code == 200
            assert closed.get("/metrics", headers={"authorization": "Bearer k1"}).status_code == 200

    def test_open_route_matching(self):
        assert is_open("/schema", ["/schema"]) and is_open("/schema/swagger", ["/schema"])
        assert not is_open("/schemas", ["/schema"]) and not is_open("/metrics2", ["/metrics"])

    def test_key_match_on_bytes(self):
        assert key_matches(b"Bearer k1", [b"k1"]) and key_matches(b"bearer k1", [b"k1"])
        assert not key_matches(b"Bearer \xff", [b"k1"]) and not key_matches(b"k1", [b"k1"])

    @pytest.mark.parametrize("header", [b"Bearer ", b"Bearer", b"bearer    ", b"Bearer \t ", b"Bearer \r"])
    def test_an_empty_or_blank_token_never_authenticates(self, header):
        # Even against keys that are themselves empty or blank (filled from an unset environment variable).
        assert not key_matches(header, [b"", b"  ", b"\t", b"k1"])

    def test_an_empty_bearer_is_401_on_a_server_whose_key_is_empty(self, services):
        config = compose_config(["server.api_keys=[k1]"])
        config.server.api_keys = ["", " "]  # what start-up refuses; the gate must still stay closed
        with TestClient(build_app(config, services)) as client:
            for header in ("Bearer ", "Bearer  ", "bearer"):
                assert_openai_error(client.get("/v1/models", headers={"authorization": header}), 401)
            assert_openai_error(client.get("/v1/models"), 401)


class TestRequestIds:
    def test_a_plain_client_id_is_echoed(self, client):
        assert (
            client.get("/v1/models", headers={"x-request-id": "abc-123_X.y:z"}).headers["x-request-id"]
            == "abc-123_X.y:z"
        )

    @pytest.mark.parametrize("value", ["x" * 65536, "has space", "new\\nline", "é"])
    def test_an_oversized_or_odd_id_is_replaced(self, client, value):
        echoed = client.get("/v1/models", headers={"x-request-id": value.encode("utf-8")}).headers["x-request-id"]
        assert echoed != value and re.fullmatch(r"[0-9a-f]{32}", echoed)


class TestMetricsCardinality:
    def test_random_paths_share_one_label(self, client):
        def hit(start, count):
            for i in range(start, start + count):
                client.get(f"/random/{i}/path")
                client.get(f"/v1/models/name-{i}")
            return client.get("/metrics").text

        client.get("/metrics")  # its own series exists before the first measurement
        before = hit(0, 2)
        body = hit(2, 200)
        assert "/random/" not in body and "name-1" not in body
        assert 'deltafin_requests_total{route="unmatched",status="404"}' in body
        assert 'route="/v1/models/{name}"' in body
        assert len(body) - len(before) < 400  # only values changed, no new series

    def test_llm_metrics_are_exported(self, client):
        client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0})
        body = client.get("/metrics").text
        for name in (
            "deltafin_completion_tokens_total",
            "deltafin_time_to_first_token_seconds_bucket",
            "deltafin_inter_token_seconds_bucket",
            "deltafin_queue_depth",
            "deltafin_engine_busy",
            "deltafin_memo_hits_total",
            "deltafin_prefix_cache_hits_total",
            "deltafin_rule_firings_total",
        ):
            assert name in body, name
