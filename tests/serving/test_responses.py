"""The Responses layer's pure parts: input items, tools, the conversation they become, the event stream a chat
stream becomes (every event parsed by the openai SDK's own models), and the bounded, scoped stores."""

from __future__ import annotations

import asyncio
import json
import sqlite3

import msgspec
import pydantic
import pytest
from openai.types.responses import Response, ResponseItem, ResponseStreamEvent

from deltafin.config import ConfigError
from deltafin.errors import InvalidRequestError, UpstreamError
from deltafin.protocol.responses import ResponsesRequest
from deltafin.serving.encoded_reasoning import decode_reasoning, encode_reasoning
from deltafin.serving.responses.conversation import chat_messages, speaks_developer
from deltafin.serving.responses.events import ResponseEvents
from deltafin.serving.responses.items import canonical_input
from deltafin.serving.responses.output import ResponseShape
from deltafin.serving.responses.store import Bounds, MemoryStore, SqliteStore
from deltafin.serving.responses.tools import chat_tool_choice, served_tools

EVENT = pydantic.TypeAdapter(ResponseStreamEvent)
ITEM = pydantic.TypeAdapter(ResponseItem)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather",
    "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
GROUP = {
    "type": "namespace",
    "name": "agents",
    "description": "Sub-agents.",
    "tools": [
        {"type": "function", "name": "spawn", "parameters": {"type": "object", "properties": {}}},
        {"type": "function", "name": "get_weather", "description": "Same name, other group"},
    ],
}


def request(**fields) -> ResponsesRequest:
    return msgspec.json.decode(msgspec.json.encode(fields), type=ResponsesRequest)


def bad(param: str):
    class Raises:
        def __enter__(self):
            self.ctx = pytest.raises(InvalidRequestError)
            self.info = self.ctx.__enter__()

        def __exit__(self, *exc):
            self.ctx.__exit__(*exc)
            assert self.info.value.param == param and self.info.value.status == 400
            return True

    return Raises()


class TestInputItems:
    def test_a_string_is_one_user_message(self):
        [item] = canonical_input("hi")
        assert item["role"] == "user" and item["content"] == [{"type": "input_text", "text": "hi"}]
        ITEM.validate_python(item)

    def test_every_kind_is_canonical_with_an_id(self):
        items = canonical_input(
            [
                {"role": "developer", "content": "be brief"},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
                {"type": "reasoning", "summary": [], "encrypted_content": encode_reasoning("think")},
                {"type": "function_call", "call_id": "c1", "name": "spawn", "namespace": "agents", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "done"}]},
            ]
        )
        assert [i["type"] for i in items] == [
            "message",
            "message",
            "reasoning",
            "function_call",
            "function_call_output",
        ]
        assert all(i["id"] for i in items)
        for item in items:
            ITEM.validate_python(item)

    @pytest.mark.parametrize(
        "value,param",
        [
            ([{"type": "web_search_call", "id": "x"}], "input[0].type"),
            ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], "input[0].content[0].type"),
            ([{"role": "tool", "content": "x"}], "input[0].role"),
            (["hi"], "input[0]"),
            ([{"type": "function_call", "call_id": "c", "name": "f"}], "input[0].arguments"),
            ([{"role": "user", "content": 3}], "input[0].content"),
            ([{"content": "no type, no role"}], "input[0].type"),
        ],
    )
    def test_unsupported_or_malformed_items_are_400_naming_them(self, value, param):
        with bad(param):
            canonical_input(value)


class TestTools:
    def test_functions_and_namespaces_with_calls_reported_under_their_own_names(self):
        served = served_tools([WEATHER, GROUP], unsupported="drop")
        names = [t.function.name for t in served.definitions]
        assert names == ["get_weather", "agents__spawn", "agents__get_weather"]
        assert served.reported("agents__get_weather") == ("get_weather", "agents")
        assert served.reported("get_weather") == ("get_weather", None)
        assert served.definitions[1].function.description == "Sub-agents."
        assert served.definitions[0].function.strict is True

    def test_hosted_tools_are_dropped_and_named_or_rejected(self):
        served = served_tools(
            [{"type": "web_search"}, WEATHER, {"type": "web_search"}, {"type": "file_search"}], unsupported="drop"
        )
        assert served.dropped == ["web_search", "file_search"] and len(served.definitions) == 1
        with bad("tools[0].type"):
            served_tools([{"type": "web_search"}], unsupported="reject")

    @pytest.mark.parametrize(
        "tools,param",
        [
            ([{"type": "custom", "name": "x"}], "tools[0].type"),
            ([WEATHER, {"type": "local_shell"}], "tools[1].type"),
            ([{"type": "function"}], "tools[0].name"),
            ([WEATHER, WEATHER], "tools[1].name"),
            (
                [{"type": "namespace", "name": "n", "tools": [{"type": "custom", "name": "x"}]}],
                "tools[0].tools[0].type",
            ),
            ([{"type": "function", "name": "f", "parameters": "no"}], "tools[0].parameters"),
        ],
    )
    def test_other_tool_types_and_bad_tools_are_400(self, tools, param):
        with bad(param):
            served_tools(tools, unsupported="drop")

    def test_tool_choice_names_functions_by_their_own_name_or_with_the_namespace(self):
        served = served_tools([WEATHER, GROUP], unsupported="drop")
        choice, _ = chat_tool_choice({"type": "function", "name": "spawn"}, served)
        assert choice == {"type": "function", "function": {"name": "agents__spawn"}}
        choice, _ = chat_tool_choice({"type": "function", "name": "get_weather", "namespace": "agents"}, served)
        assert choice["function"]["name"] == "agents__get_weather"
        mode, allowed = chat_tool_choice(
            {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_weather"}]},
            served,
        )
        assert mode == "required" and [t.function.name for t in allowed] == ["get_weather"]
        with bad("tool_choice.name"):
            chat_tool_choice({"type": "function", "name": "nope"}, served)
        with bad("tool_choice.type"):
            chat_tool_choice({"type": "web_search_preview"}, served)


class TestConversation:
    def test_a_function_call_round_trip_keeps_calls_outputs_and_reasoning(self):
        items = canonical_input(
            [
                {"role": "developer", "content": "Use tools."},
                {"role": "user", "content": "Weather in Paris?"},
                {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Need weather."}]},
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
                {"type": "function_call", "call_id": "c2", "name": "spawn", "namespace": "agents", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                {"type": "function_call_output", "call_id": "c2", "output": "spawned"},
                {"role": "assistant", "content": "Sunny."},
                {"role": "user", "content": "Thanks"},
            ]
        )
        messages = chat_messages("Be kind.", items, developer_role=False)
        assert [m.role for m in messages] == ["system", "user", "assistant", "tool", "tool", "assistant", "user"]
        assert messages[0].content == "Be kind.\n\nUse tools."
        turn = messages[2]
        assert turn.reasoning_content == "Need weather." and turn.content is None
        assert [(c.id, c.function.name) for c in turn.tool_calls] == [("c1", "get_weather"), ("c2", "agents__spawn")]
        assert (messages[3].tool_call_id, messages[3].name, messages[3].content) == ("c1", "get_weather", "sunny")
        assert messages[5].content == "Sunny." and messages[5].tool_calls is None

    def test_developer_stays_developer_where_the_template_has_the_role(self):
        items = canonical_input([{"role": "user", "content": "a"}, {"role": "developer", "content": "b"}])
        assert [m.role for m in chat_messages(None, items, developer_role=True)] == ["user", "developer"]
        assert [m.role for m in chat_messages(None, items, developer_role=False)] == ["user", "system"]
        assert speaks_developer("template", "{% if m.role == 'developer' %}") is True
        assert speaks_developer("template", "{{ message.role }}") is False
        assert speaks_developer("xtml", None) is True

    def test_replayed_encoded_reasoning_is_that_turns_reasoning(self):
        items = canonical_input(
            [
                {"role": "user", "content": "q"},
                {"type": "reasoning", "summary": [], "encrypted_content": encode_reasoning("é ok")},
                {"role": "assistant", "content": "a"},
            ]
        )
        assert chat_messages(None, items, developer_role=True)[1].reasoning_content == "é ok"
        assert decode_reasoning("gAAAAB-openai-state") is None
        assert decode_reasoning(encode_reasoning("x")[:-2] + "!!") is None


async def _chunks(chunks):
    for chunk in chunks:
        yield chunk


def _events(chunks, req=None, fail=None):
    shape = ResponseShape(
        req or request(input="q", include=["reasoning.encrypted_content"]),
        served_tools([WEATHER, GROUP], unsupported="drop"),
        "m",
    )
    stream = ResponseEvents(shape, lambda: 3)

    async def run():
        out = []
        try:
            async for event in stream.events(_chunks(chunks) if fail is None else fail):
                out.append(event)
        except UpstreamError as exc:
            out += stream.failed(exc)
        return out

    return asyncio.run(run())


def _delta(**delta):
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": None, "logprobs": None}]}


class TestEvents:
    def test_reasoning_text_and_calls_stream_in_openai_order_and_parse(self):
        chunks = [
            _delta(role="assistant", content=""),
            _delta(reasoning_content="Hm"),
            _delta(reasoning_content="m."),
            _delta(content="Hi"),
            _delta(content="!"),
            _delta(
                tool_calls=[
                    {
                        "index": 0,
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "agents__spawn", "arguments": ""},
                    }
                ]
            ),
            _delta(tool_calls=[{"index": 0, "function": {"arguments": "{}"}}]),
            {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls", "logprobs": None}]},
            {
                "choices": [],
                "usage": {
                    "prompt_tokens": 5,
                    "completion_tokens": 9,
                    "total_tokens": 14,
                    "prompt_tokens_details": {"cached_tokens": 2},
                },
            },
        ]
        events = _events(chunks)
        for event in events:
            EVENT.validate_python(event)
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        kinds = [e["type"] for e in events]
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        assert (
            kinds.index("response.reasoning_text.delta")
            < kinds.index("response.output_text.delta")
            < kinds.index("response.function_call_arguments.delta")
        )
        final = Response.model_validate(events[-1]["response"])
        assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
        reasoning, message, call = final.output
        assert reasoning.content[0].text == "Hmm." and decode_reasoning(reasoning.encrypted_content) == "Hmm."
        assert message.content[0].text == "Hi!" and final.output_text == "Hi!"
        assert (call.name, call.namespace, call.call_id, call.arguments) == ("spawn", "agents", "call_1", "{}")
        assert final.usage.input_tokens == 5 and final.usage.output_tokens_details.reasoning_tokens == 3
        assert final.usage.input_tokens_details.cached_tokens == 2
        done = [e["item"]["id"] for e in events if e["type"] == "response.output_item.done"]
        added = [e["item"]["id"] for e in events if e["type"] == "response.output_item.added"]
        assert done == added == [item.id for item in final.output]

    def test_a_cut_answer_is_incomplete(self):
        events = _events([_delta(content="a"), {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}])
        final = Response.model_validate(events[-1]["response"])
        assert events[-1]["type"] == "response.incomplete" and final.status == "incomplete"
        assert final.incomplete_details.reason == "max_output_tokens" and final.output[0].status == "incomplete"

    def test_an_empty_answer_is_an_empty_message(self):
        events = _events([{"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}])
        assert Response.model_validate(events[-1]["response"]).output_text == ""

    def test_an_error_mid_stream_ends_with_response_failed(self):
        async def failing():
            yield _delta(content="par")
            raise UpstreamError("upstream went away")

        events = _events(None, fail=failing())
        for event in events:
            EVENT.validate_python(event)
        assert events[-1]["type"] == "response.failed"
        assert events[-1]["response"]["error"] == {"code": "server_error", "message": "upstream went away"}
        assert [e["sequence_number"] for e in events] == list(range(len(events)))


class TestRequestChecks:
    @pytest.mark.parametrize(
        "fields,param",
        [
            ({"background": True}, "background"),
            ({"conversation": "conv_1"}, "conversation"),
            ({"prompt": {"id": "p"}}, "prompt"),
            ({"max_tool_calls": 3}, "max_tool_calls"),
            ({"truncation": "sometimes"}, "truncation"),
            ({"include": ["nope"]}, "include[0]"),
            ({"reasoning": {"effort": "maximal"}}, "reasoning.effort"),
            ({"text": {"verbosity": "high"}}, "text.verbosity"),
            ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
            ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
            ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ],
    )
    def test_fields_deltafin_does_not_serve_are_400_by_name(self, fields, param):
        with bad(param):
            request(input="q", **fields).check()

    def test_what_codex_sends_passes(self):
        request(
            input="q",
            store=False,
            include=["reasoning.encrypted_content"],
            prompt_cache_key="k",
            client_metadata={"a": "b"},
            reasoning={"summary": "auto"},
            background=False,
            service_tier="auto",
        ).check()


class TestStores:
    RECORD = {"response": {"id": "r", "output": []}, "input": [{"type": "message"}], "context": []}

    @pytest.fixture(params=["memory", "sqlite"])
    def make(self, request, tmp_path):
        def make(entries=10, max_bytes=1 << 20):
            bounds = Bounds(entries, max_bytes, entries, max_bytes)
            if request.param == "memory":
                return MemoryStore(bounds)
            return SqliteStore(str(tmp_path / "responses.db"), bounds)

        return make

    def test_records_are_scoped_to_their_owner(self, make):
        store = make()
        assert store.put("alice", "r1", self.RECORD)
        assert store.get("alice", "r1") == self.RECORD and store.get("bob", "r1") is None
        assert not store.delete("bob", "r1") and store.delete("alice", "r1") and store.get("alice", "r1") is None

    def test_oldest_leave_first_by_count_and_by_bytes(self, make):
        store = make(entries=3)
        for i in range(5):
            store.put("o", f"r{i}", self.RECORD)
        assert [store.get("o", f"r{i}") is not None for i in range(5)] == [False, False, True, True, True]
        size = len(msgspec.json.encode(self.RECORD))
        store = make(entries=100, max_bytes=2 * size)
        for i in range(3):
            store.put("o", f"r{i}", self.RECORD)
        assert [store.get("o", f"r{i}") is not None for i in range(3)] == [False, True, True]
        assert not store.put("o", "big", {"x": "y" * 3 * size}) and store.get("o", "big") is None

    def test_sqlite_keeps_records_across_reopen_in_wal_mode(self, tmp_path):
        path = tmp_path / "r.db"
        bounds = Bounds(10, 1 << 20, 10, 1 << 20)
        SqliteStore(str(path), bounds).put("o", "r1", self.RECORD)
        again = SqliteStore(str(path), bounds)
        assert again.get("o", "r1") == self.RECORD
        assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"

    def test_sqlite_refuses_a_foreign_or_corrupt_file_and_a_missing_folder(self, tmp_path):
        bounds = Bounds(10, 100, 10, 100)
        junk = tmp_path / "junk.db"
        junk.write_bytes(b"not a database at all" * 100)
        with pytest.raises(ConfigError, match="server.responses.path"):
            SqliteStore(str(junk), bounds)
        other = tmp_path / "other.db"
        sqlite3.connect(other).execute("CREATE TABLE t (x)")
        with pytest.raises(ConfigError, match="not a Deltafin response store"):
            SqliteStore(str(other), bounds)
        with pytest.raises(ConfigError, match="does not exist"):
            SqliteStore(str(tmp_path / "no" / "r.db"), bounds)
        assert json.loads(json.dumps(self.RECORD)) == self.RECORD  # the records themselves are plain JSON (no tuples)
