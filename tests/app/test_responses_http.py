"""/v1/responses in process (the real default model, no network): stored responses scoped to the API key, hosted
tools dropped and named (or refused), truncation, the refusals that name their field, /schema."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import threading

import pytest
from litestar.testing import TestClient
from openai.types.responses import Response

from deltafin.app import build_app
from deltafin.app.services import Services
from deltafin.serving.responses.store import Bounds, SqliteStore
from tests.app.test_http import assert_openai_error
from tests.conftest import compose_config, make_engine

RESPONSES = "/v1/responses"
KEYS = ["server.api_keys=[alice-key,bob-key]"]


def ask(**fields):
    return {"model": "smollm2", "input": "Say hi.", "max_output_tokens": 2, "temperature": 0, **fields}


@pytest.fixture(scope="module")
def keyed(services):
    with TestClient(build_app(compose_config(KEYS), services)) as client:
        yield client


@pytest.fixture(scope="module")
def client(config, services):
    with TestClient(build_app(config, services)) as client:
        yield client


def as_(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


class TestStoredResponses:
    def test_another_key_finds_nothing(self, keyed):
        created = keyed.post(RESPONSES, json=ask(), headers=as_("alice-key"))
        assert created.status_code == 200, created.text
        rid = Response.model_validate(created.json()).id
        assert keyed.get(f"{RESPONSES}/{rid}", headers=as_("alice-key")).json()["id"] == rid
        for method, path in [
            ("get", f"{RESPONSES}/{rid}"),
            ("get", f"{RESPONSES}/{rid}/input_items"),
            ("delete", f"{RESPONSES}/{rid}"),
        ]:
            assert_openai_error(getattr(keyed, method)(path, headers=as_("bob-key")), 404)
        follow = keyed.post(RESPONSES, json=ask(previous_response_id=rid), headers=as_("bob-key"))
        assert_openai_error(follow, 404, "previous_response_id")
        assert keyed.delete(f"{RESPONSES}/{rid}", headers=as_("alice-key")).json() == {
            "id": rid,
            "object": "response",
            "deleted": True,
        }
        assert_openai_error(keyed.get(f"{RESPONSES}/{rid}", headers=as_("alice-key")), 404)

    def test_input_items_page_in_either_order(self, client):
        created = client.post(RESPONSES, json=ask(input=[{"role": "user", "content": f"m{i}"} for i in range(5)]))
        rid = created.json()["id"]
        page = client.get(f"{RESPONSES}/{rid}/input_items", params={"limit": 2, "order": "asc"}).json()
        texts = [item["content"][0]["text"] for item in page["data"]]
        assert texts == ["m0", "m1"] and page["has_more"] and page["first_id"] == page["data"][0]["id"]
        rest = client.get(f"{RESPONSES}/{rid}/input_items", params={"after": page["last_id"], "order": "asc"}).json()
        assert [item["content"][0]["text"] for item in rest["data"]] == ["m2", "m3", "m4"] and not rest["has_more"]
        newest = client.get(f"{RESPONSES}/{rid}/input_items").json()["data"][0]
        assert newest["content"][0]["text"] == "m4"
        assert_openai_error(client.get(f"{RESPONSES}/{rid}/input_items", params={"order": "up"}), 400, "order")
        assert_openai_error(client.get(f"{RESPONSES}/{rid}/input_items", params={"limit": 0}), 400, "limit")


class TestToolsAndRefusals:
    def test_hosted_tools_are_dropped_and_named_in_a_header(self, client):
        response = client.post(
            RESPONSES, json=ask(tools=[{"type": "web_search"}, {"type": "file_search", "vector_store_ids": ["v"]}])
        )
        assert response.status_code == 200, response.text
        assert response.headers["x-deltafin-dropped-tools"] == "web_search,file_search"
        assert "x-deltafin-dropped-tools" not in client.post(RESPONSES, json=ask()).headers

    def test_reject_refuses_hosted_tools(self, loaded_model):
        config = compose_config(["server.responses.unsupported_tools=reject"])
        with TestClient(build_app(config, Services.from_engine(config, make_engine(loaded_model)))) as client:
            assert_openai_error(client.post(RESPONSES, json=ask(tools=[{"type": "web_search"}])), 400, "tools[0].type")

    @pytest.mark.parametrize(
        "fields,param",
        [
            ({"background": True}, "background"),
            ({"input": [{"type": "computer_call_output", "call_id": "c"}]}, "input[0].type"),
            ({"tools": [{"type": "custom", "name": "patch"}]}, "tools[0].type"),
            ({"reasoning": {"effort": "high"}}, "reasoning.effort"),  # this model has no thinking switch
            ({"input": ""}, None),
            ({"input": []}, "input"),
            ({"max_output_tokens": 0}, "max_output_tokens"),
            ({"temperature": "hot"}, "temperature"),
            (
                {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "no-such-type"}}}},
                "response_format.json_schema.schema",
            ),
        ],
    )
    def test_refusals_name_their_field(self, client, fields, param):
        response = client.post(RESPONSES, json=ask(**fields))
        if param is None:
            assert response.status_code == 200, response.text  # an empty string is an empty user message
        else:
            assert_openai_error(response, 400, param)

    def test_reasoning_effort_none_is_served_on_a_model_that_does_not_reason(self, client):
        response = client.post(RESPONSES, json=ask(reasoning={"effort": "none", "summary": "auto"}))
        assert response.status_code == 200, response.text
        body = response.json()
        # answered, with no reasoning item (there is none to summarize)
        assert [item["type"] for item in body["output"]] == ["message"], body
        assert body["output"][0]["content"][0]["text"] and body["usage"]["output_tokens"] == 2, body


def test_output_text_logprobs_when_included(client):
    response = client.post(RESPONSES, json=ask(include=["message.output_text.logprobs"], top_logprobs=2))
    part = Response.model_validate(response.json()).output[0].content[0]
    assert len(part.logprobs) == response.json()["usage"]["output_tokens"]
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in part.logprobs)
    assert "".join(lp.token for lp in part.logprobs) == part.text


@pytest.fixture(scope="module")
def short_context(config, loaded_model):
    """The default model served with a 1,024-token context, so a history that overflows it prefills in
    seconds, not minutes (the truncation logic reads only the engine's context length)."""
    from deltafin.app.services import Services

    loaded = dataclasses.replace(loaded_model, context_length=1024)
    with TestClient(build_app(config, Services.from_engine(config, make_engine(loaded)))) as client:
        yield client


class TestTruncation:
    LONG = "Tell me about the sea. " * 100  # ~600 tokens: two turns of it do not fit a 1,024-token context

    def turns(self) -> list:
        return [
            {"role": "user", "content": self.LONG},
            {"role": "assistant", "content": "The sea is large."},
            {"role": "user", "content": self.LONG},
            {"role": "assistant", "content": "It is deep."},
            {"role": "user", "content": "Thanks. One word?"},
        ]

    def test_disabled_refuses_what_does_not_fit(self, short_context):
        error = assert_openai_error(short_context.post(RESPONSES, json=ask(input=self.turns())), 400)
        assert error["code"] == "context_length_exceeded"

    def test_auto_drops_the_oldest_turns(self, short_context):
        response = short_context.post(
            RESPONSES, json=ask(input=self.turns(), truncation="auto", instructions="Be brief.")
        )
        assert response.status_code == 200, response.text
        body = Response.model_validate(response.json())
        # the first long turn and its answer dropped, the second kept whole
        assert body.truncation == "auto" and 500 < body.usage.input_tokens < 1024


def test_schema_documents_the_responses_route(client):
    paths = client.get("/schema/openapi.json").json()["paths"]
    assert "post" in paths["/v1/responses"] and "get" in paths["/v1/responses/{response_id}"]
    assert "delete" in paths["/v1/responses/{response_id}"]


def stream_events(response) -> list[dict]:
    return [json.loads(line[len("data: ") :]) for line in response.text.splitlines() if line.startswith("data: ")]


class TestStoreFailures:
    """A store that cannot be written (locked by another process, a full disk) costs the client nothing it
    generated: the answer comes back whole, marked `store: false` (and a stream ends normally, never cut); a damaged
    stored record is a 404 naming it, never a 500."""

    @pytest.fixture
    def locked(self, config, loaded_model, tmp_path):
        path = tmp_path / "responses.db"
        store = SqliteStore(str(path), Bounds(100, 1 << 30, 100, 1 << 30), busy_timeout_s=0.1)
        with TestClient(build_app(config, Services.from_engine(config, make_engine(loaded_model), store))) as client:
            yield client, path

    def hold_the_lock(self, path):
        other = sqlite3.connect(path, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        return other

    def test_an_answer_that_cannot_be_stored_is_still_answered(self, locked):
        client, path = locked
        other = self.hold_the_lock(path)
        try:
            response = client.post(RESPONSES, json=ask())
        finally:
            other.execute("ROLLBACK")
        assert response.status_code == 200, response.text
        body = Response.model_validate(response.json())
        assert body.store is False and body.output and response.headers["x-deltafin-store"] == "not stored"
        assert_openai_error(client.get(f"{RESPONSES}/{body.id}"), 404)  # as it says: not stored

    def test_a_stream_that_cannot_be_stored_ends_normally(self, locked):
        client, path = locked
        other = self.hold_the_lock(path)
        try:
            response = client.post(RESPONSES, json=ask(stream=True))
        finally:
            other.execute("ROLLBACK")
        events = stream_events(response)
        assert events[-1]["type"] in ("response.completed", "response.incomplete")  # max_output_tokens: 2
        assert events[-1]["response"]["store"] is False and events[-1]["response"]["output"]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))

    def test_anything_unexpected_after_the_stream_began_ends_it_with_response_failed(self, client, monkeypatch):
        """docs/api.md's promise for every error after the first byte, not only Deltafin's own (it was a cut stream)."""
        from deltafin.serving.responses import service

        real = service.sse

        def failing(event):
            if event["type"] == "response.output_text.delta":
                raise RuntimeError("a bug")
            return real(event)

        monkeypatch.setattr(service, "sse", failing)
        events = stream_events(client.post(RESPONSES, json=ask(stream=True)))
        assert events[-1]["type"] == "response.failed" and events[-1]["response"]["error"]["code"] == "server_error"
        numbers = [e["sequence_number"] for e in events]
        assert numbers == sorted(set(numbers))  # (the event that failed to be written keeps its number)

    @pytest.mark.parametrize(
        "damage", [b"{not json", b'{"context": [], "input": [{"type": 5}], "response": {"output": []}}']
    )
    def test_a_damaged_record_is_404_naming_it(self, locked, damage):
        client, path = locked
        rid = client.post(RESPONSES, json=ask()).json()["id"]
        db = sqlite3.connect(path)
        db.execute("UPDATE deltafin_responses SET body = ? WHERE id = ?", (damage, rid))
        db.commit()
        error = assert_openai_error(client.get(f"{RESPONSES}/{rid}"), 404)
        assert "damaged" in error["message"]
        assert_openai_error(client.post(RESPONSES, json=ask(previous_response_id=rid)), 404, "previous_response_id")
        assert client.delete(f"{RESPONSES}/{rid}").status_code == 200


class TestLargeConversations:
    """A tiny request continuing a large stored conversation: rendered where its conversation's size says (a
    prompt thread, never the event loop), and `truncation: "auto"` cut in one measured pass."""

    def stored(self, client, turns: int, text: str) -> str:
        """A stored response whose conversation holds `turns` user/assistant turns of `text`."""
        items = []
        for i in range(turns):
            items += [{"role": "user", "content": f"{i}: {text}"}, {"role": "assistant", "content": f"Noted {i}."}]
        created = client.post(RESPONSES, json=ask(input=[*items, {"role": "user", "content": "hi"}], truncation="auto"))
        assert created.status_code == 200, created.text
        return created.json()["id"]

    def test_the_conversation_not_the_body_chooses_where_it_renders(self, config, short_context, monkeypatch):
        from deltafin.serving.chat import ChatService

        rid = self.stored(short_context, 2, "word " * 20)
        threads = []
        render = ChatService.render

        def recording(self, request, **kwargs):
            threads.append(threading.current_thread().name)
            return render(self, request, **kwargs)

        monkeypatch.setattr(ChatService, "render", recording)
        # the stored record grows past the large-body size: a 140-byte request continuing it
        big = self.stored(short_context, 1, "x " * config.server.queue.large_body_bytes)
        threads.clear()
        response = short_context.post(RESPONSES, json=ask(previous_response_id=big, input="and?", truncation="auto"))
        assert response.status_code in (200, 400), response.text
        assert threads and all(name.startswith("deltafin-prompt-large") for name in threads), threads
        threads.clear()
        short_context.post(RESPONSES, json=ask(previous_response_id=rid, input="and?"))
        assert threads == [threading.main_thread().name] or not threads[0].startswith("deltafin-prompt-large")

    def test_auto_truncation_renders_a_few_times_however_many_turns_go(self, short_context, monkeypatch):
        from deltafin.serving.chat import ChatService

        renders = []
        render = ChatService.render
        monkeypatch.setattr(
            ChatService, "render", lambda self, request, **kw: renders.append(1) or render(self, request, **kw)
        )
        turns = 60  # ~45 tokens a turn: over twice the 1,024-token context
        items = []
        for i in range(turns):
            items += [
                {"role": "user", "content": f"Turn {i}: " + "tell me more " * 8},
                {"role": "assistant", "content": "Sure."},
            ]
        response = short_context.post(
            RESPONSES, json=ask(input=[*items, {"role": "user", "content": "Last one?"}], truncation="auto")
        )
        assert response.status_code == 200, response.text
        body = Response.model_validate(response.json())
        assert 500 < body.usage.input_tokens < 1024  # most of the context used: the cut is not far too deep
        assert len(renders) <= 3, len(renders)  # before: one render per dropped turn (here ~35)

    def test_a_large_conversation_is_cut_before_its_first_render(self, config, short_context, monkeypatch):
        """Rendering 3.8 MB only to learn it does not fit is seconds of template work holding the GIL the engine
        needs: a conversation past the large-body size is measured and cut first, and never rendered whole."""
        from deltafin.serving.chat import ChatService

        rendered = []
        render = ChatService.render
        monkeypatch.setattr(
            ChatService,
            "render",
            lambda self, request, **kw: rendered.append(len(request.messages)) or render(self, request, **kw),
        )
        turn = "tell me more about the sea " * 30  # ~800 bytes, ~180 tokens
        items = []
        for i in range(config.server.queue.large_body_bytes // len(turn) + 10):
            items += [{"role": "user", "content": f"{i}: {turn}"}, {"role": "assistant", "content": "Sure."}]
        response = short_context.post(
            RESPONSES, json=ask(input=[*items, {"role": "user", "content": "Last?"}], truncation="auto")
        )
        assert response.status_code == 200, response.text
        assert rendered and max(rendered) < len(items) // 4, rendered  # a handful of turns, from the first render on
        assert 300 < Response.model_validate(response.json()).usage.input_tokens < 1024
