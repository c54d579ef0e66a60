"""Anthropic Messages on the chat path (deltafin.serving.messages): literal Anthropic request in, literal chat
request out; chat answers in, Message objects and events out, read back with the `anthropic` SDK's own types and
stream accumulator."""

from __future__ import annotations

import asyncio
import json
import re

import msgspec
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from deltafin.errors import (
    AuthenticationError,
    EngineBusyError,
    EngineUnavailableError,
    InvalidRequestError,
    ModelNotFoundError,
    PayloadTooLargeError,
    anthropic_error,
)
from deltafin.protocol.chat import ChatMessage
from deltafin.protocol.messages import CountTokensRequest, MessagesRequest
from deltafin.serving.encoded_reasoning import decode_reasoning, encode_reasoning
from deltafin.serving.messages.conversation import fold_inline_system, system_text
from deltafin.serving.messages.output import PING, MessageEvents, MessageShape, pinged
from deltafin.serving.messages.request import chat_request

BILLING = "x-anthropic-billing-header: cc_version=2.1.332.34c; cc_entrypoint=sdk-cli;"
WEATHER = {
    "name": "get_weather",
    "description": "Weather for a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def messages_request(**fields) -> MessagesRequest:
    body = {"model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}], **fields}
    return msgspec.convert(body, MessagesRequest)


def served(thinking_kwarg: str | None = "thinking", inline_system: bool = True, **fields):
    return chat_request(messages_request(**fields), thinking_kwarg=thinking_kwarg, inline_system=inline_system)


def plain(messages: list[ChatMessage]) -> list[dict]:
    return [msgspec.to_builtins(m) for m in messages]


class TestSystem:
    def test_the_billing_header_block_is_dropped(self):
        system = [{"type": "text", "text": BILLING}, {"type": "text", "text": "A."}, {"type": "text", "text": "B."}]
        assert plain(served(system=system).messages)[0] == {"role": "system", "content": "A.\nB."}

    def test_a_string_system_keeps_what_follows_a_billing_line(self):
        assert system_text(f"{BILLING}\nBe brief.") == "Be brief."
        assert system_text("Be brief.") == "Be brief." and system_text(None) == ""

    def test_inline_system_stays_in_place(self):
        messages = [
            {"role": "user", "content": "hi"},
            {"role": "system", "content": [{"type": "text", "text": "# Environment", "cache_control": {}}]},
        ]
        out = served(system="S", messages=messages).messages
        assert [(m.role, m.content) for m in out] == [("system", "S"), ("user", "hi"), ("system", "# Environment")]

    def test_inline_system_is_folded_where_the_template_cannot_place_it(self):
        messages = [
            {"role": "user", "content": "hi"},
            {"role": "system", "content": "env"},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "next"},
        ]
        out = served(system="S", messages=messages, inline_system=False).messages
        assert [(m.role, m.content) for m in out] == [
            ("system", "S"),
            ("user", "hi"),
            ("assistant", "ok"),
            ("user", "env\n\nnext"),
        ]

    def test_a_trailing_system_turn_folds_into_the_last_user_turn(self):
        messages = [ChatMessage(role="user", content="hi"), ChatMessage(role="system", content="env")]
        assert [(m.role, m.content) for m in fold_inline_system(messages)] == [("user", "hi\n\nenv")]

    def test_leading_system_turns_are_joined(self):
        out = served(system="S", messages=[{"role": "system", "content": "T"}, {"role": "user", "content": "hi"}])
        assert [(m.role, m.content) for m in out.messages] == [("system", "S\n\nT"), ("user", "hi")]


class TestTools:
    HISTORY = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Need it.", "signature": "foreign-signature"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Nice"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny", "cache_control": {}},
                {"type": "text", "text": "<system-reminder>x</system-reminder>"},
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_2",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    "is_error": False,
                },
            ],
        },
    ]

    def test_calls_and_results_map_to_chat(self):
        out = plain(served(messages=self.HISTORY, tools=[WEATHER]).messages)
        assert out[1] == {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "Need it.",
            "tool_calls": [
                {
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    "id": "toolu_1",
                    "type": "function",
                },
                {
                    "function": {"name": "get_weather", "arguments": '{"city": "Nice"}'},
                    "id": "toolu_2",
                    "type": "function",
                },
            ],
        }
        # results right after the calls, in block order; the user's own text after them
        assert out[2:] == [
            {"role": "tool", "content": "sunny", "name": "get_weather", "tool_call_id": "toolu_1"},
            {"role": "tool", "content": "a\nb", "name": "get_weather", "tool_call_id": "toolu_2"},
            {"role": "user", "content": "<system-reminder>x</system-reminder>"},
        ]

    def test_an_empty_failed_result_still_says_it_failed(self):
        history = [*self.HISTORY[:2], {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "File does not exist.", "is_error": True},
        ]}]  # fmt: skip
        out = served(messages=history, tools=[WEATHER]).messages
        assert [m.content for m in out[2:]] == ["Error", "File does not exist."]

    def test_tools_and_choices(self):
        request = served(tools=[WEATHER], tool_choice={"type": "any", "disable_parallel_tool_use": True})
        assert request.tool_choice == "required" and request.parallel_tool_calls is False
        (tool,) = request.tools
        assert (tool.function.name, tool.function.parameters) == ("get_weather", WEATHER["input_schema"])
        named = served(tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
        assert named.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
        assert named.parallel_tool_calls is None
        assert served(tools=[WEATHER], tool_choice={"type": "none"}).tool_choice == "none"
        assert served(tools=[WEATHER]).tool_choice is None  # auto

    def test_deferred_tools_wait_for_a_tool_reference(self):
        deferred = {**WEATHER, "name": "WebFetch", "defer_loading": True}
        placeholder = {"name": "DeferredToolPlaceholder", "input_schema": {"type": "object"}, "defer_loading": True}
        tools = [WEATHER, deferred, placeholder]
        assert [t.function.name for t in served(tools=tools).tools] == ["get_weather"]
        loaded = [
            {"role": "user", "content": "fetch"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "ToolSearch", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
                {"type": "tool_reference", "tool_name": "WebFetch"}]}]},
        ]  # fmt: skip
        request = served(tools=tools, messages=loaded)
        assert [t.function.name for t in request.tools] == ["get_weather", "WebFetch"]
        assert request.messages[-1].content == "Tool WebFetch loaded."

    @pytest.mark.parametrize(
        "tool,param",
        [
            ({"type": "web_search_20250305", "name": "web_search"}, "tools.0.type"),
            ({"name": "f"}, "tools.0.input_schema"),
        ],
    )
    def test_tools_this_server_cannot_run_are_refused(self, tool, param):
        with pytest.raises(InvalidRequestError) as info:
            served(tools=[tool])
        assert info.value.param == param

    def test_a_named_choice_needs_a_name(self):
        with pytest.raises(InvalidRequestError, match="tool_choice.name"):
            served(tools=[WEATHER], tool_choice={"type": "tool"})


class TestThinking:
    def test_enabled_with_a_budget(self):
        request = served(thinking={"type": "enabled", "budget_tokens": 100})
        assert request.chat_template_kwargs == {"thinking": True} and request.thinking_token_budget == 100

    def test_budgets_under_anthropics_minimum_are_accepted(self):
        assert served(thinking={"type": "enabled", "budget_tokens": 16}).thinking_token_budget == 16

    @pytest.mark.parametrize("kind,on", [("adaptive", True), ("disabled", False)])
    def test_adaptive_and_disabled(self, kind, on):
        request = served(thinking={"type": kind, "display": "omitted"})
        assert request.chat_template_kwargs == {"thinking": on} and request.thinking_token_budget is None

    def test_a_model_without_a_thinking_switch_ignores_it(self):
        request = served(thinking_kwarg=None, thinking={"type": "enabled", "budget_tokens": 100})
        assert request.chat_template_kwargs is None and request.thinking_token_budget is None
        assert served().chat_template_kwargs is None  # none sent: the model's default

    def test_a_signature_issued_here_brings_the_reasoning_back(self):
        history = [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "", "signature": encode_reasoning("Hidden thought.")},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "A."}]},
            {"role": "user", "content": "again"},
        ]  # fmt: skip
        assert served(messages=history).messages[1].reasoning_content == "Hidden thought."

    def test_unsigned_and_foreign_blocks_are_accepted(self):
        for block in ({"type": "thinking", "thinking": "T."}, {"type": "thinking", "thinking": "T.", "signature": ""}):
            history = [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": [block, {"type": "text", "text": "A."}]},
                {"role": "user", "content": "again"},
            ]
            assert served(messages=history).messages[1].reasoning_content == "T."


class TestSampling:
    def test_fields_map_to_chat(self):
        request = served(stop_sequences=["END"], temperature=0.5, top_p=0.9, top_k=5, stream=True)
        assert (request.max_tokens, request.stop, request.temperature, request.top_p, request.top_k) == (
            100,
            ["END"],
            0.5,
            0.9,
            5,
        )
        assert request.stream and request.include_usage

    def test_output_format_is_a_response_format(self):
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
        request = served(output_config={"effort": "high", "format": {"type": "json_schema", "schema": schema}})
        assert request.response_format.type == "json_schema" and request.response_format.json_schema.schema == schema

    def test_count_tokens_requests_carry_no_budget(self):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}
        request = chat_request(msgspec.convert(body, CountTokensRequest), thinking_kwarg=None)
        assert request.max_tokens is None and [t.function.name for t in request.tools] == ["get_weather"]


class TestRefusals:
    def test_images_are_refused_naming_the_block(self):
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
        with pytest.raises(InvalidRequestError) as info:
            served(messages=[{"role": "user", "content": [{"type": "text", "text": "x"}, image]}])
        assert info.value.param == "messages.0.content.1" and "text only" in info.value.message

    def test_an_assistant_prefill_is_refused(self):
        with pytest.raises(InvalidRequestError, match="prefill"):
            served(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer is"}])

    def test_a_block_in_the_wrong_turn_is_refused(self):
        with pytest.raises(InvalidRequestError) as info:
            served(messages=[{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}])
        assert info.value.param == "messages.0.content.0" and "tool_use" in info.value.message


def chat_body(message: dict, finish: str, stop_reason=None, cached: int = 0) -> dict:
    return {
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "stop_reason": stop_reason}],
        "usage": {"prompt_tokens": 30, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": cached}},
    }


class TestMessage:
    def shape(self, omit: bool = False, stops=None) -> MessageShape:
        return MessageShape("claude-x", omit_thinking=omit, stop_sequences=stops)

    def test_blocks_in_order_with_parsed_input(self):
        call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
        message = {"content": "Hi.", "reasoning_content": "Think.", "tool_calls": [call]}
        body = self.shape().from_chat(chat_body(message, "tool_calls", cached=20))
        parsed = Message.model_validate(body)
        assert [block.type for block in parsed.content] == ["thinking", "text", "tool_use"]
        assert parsed.content[0].thinking == "Think." and decode_reasoning(parsed.content[0].signature) == "Think."
        assert parsed.content[2].input == {"a": 1} and parsed.stop_reason == "tool_use" and parsed.model == "claude-x"
        assert (parsed.usage.input_tokens, parsed.usage.cache_read_input_tokens, parsed.usage.output_tokens) == (
            10,
            20,
            7,
        )

    def test_omitted_thinking_travels_in_the_signature_only(self):
        body = self.shape(omit=True).from_chat(chat_body({"content": "A", "reasoning_content": "T."}, "stop"))
        assert body["content"][0]["thinking"] == "" and decode_reasoning(body["content"][0]["signature"]) == "T."

    @pytest.mark.parametrize(
        "finish,matched,expected",
        [
            ("stop", None, ("end_turn", None)),
            ("stop", "END", ("stop_sequence", "END")),
            ("stop", 2, ("end_turn", None)),
            ("length", None, ("max_tokens", None)),
        ],
    )
    def test_stop_reasons(self, finish, matched, expected):
        body = self.shape(stops=["END"]).from_chat(chat_body({"content": "x"}, finish, matched))
        assert (body["stop_reason"], body["stop_sequence"]) == expected

    def test_arguments_that_are_not_an_object_give_an_empty_input(self):
        call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": '}}
        body = self.shape().from_chat(chat_body({"content": None, "tool_calls": [call]}, "length"))
        assert body["content"] == [{"type": "tool_use", "id": "c", "name": "f", "input": {}}]


async def _chunks(items):
    for item in items:
        yield item


def _chunk(delta: dict | None = None, finish=None, stop_reason=None, usage=None) -> dict:
    if usage is not None:
        return {"choices": [], "usage": usage}
    choice = {"index": 0, "delta": delta or {}, "finish_reason": finish}
    if finish is not None:
        choice["stop_reason"] = stop_reason
    return {"choices": [choice]}


STREAM = [
    _chunk({"role": "assistant", "content": ""}),
    _chunk({"reasoning_content": "Let me "}),
    _chunk({"reasoning_content": "think."}),
    _chunk({"content": "I'll call."}),
    _chunk({"tool_calls": [{"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": ""}}]}),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]}),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}),
    _chunk(
        {"tool_calls": [{"index": 1, "id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]}
    ),
    _chunk(finish="tool_calls"),
    _chunk(usage={"prompt_tokens": 12, "completion_tokens": 9, "prompt_tokens_details": {"cached_tokens": 4}}),
]


def events_of(chunks, **shape) -> list[dict]:
    events = MessageEvents(MessageShape("m", omit_thinking=False, stop_sequences=None, **shape), prompt_tokens=12)

    async def collect():
        return [event async for event in events.events(_chunks(chunks))]

    return asyncio.run(collect())


class TestEvents:
    def test_anthropics_event_sequence(self):
        kinds = [
            (e["type"], e.get("delta", {}).get("type") or e.get("content_block", {}).get("type"))
            for e in events_of(STREAM)
        ]
        assert kinds == [
            ("message_start", None),
            ("ping", None),
            ("content_block_start", "thinking"),
            ("content_block_delta", "thinking_delta"),
            ("content_block_delta", "thinking_delta"),
            ("content_block_delta", "signature_delta"),
            ("content_block_stop", None),
            ("content_block_start", "text"),
            ("content_block_delta", "text_delta"),
            ("content_block_stop", None),
            ("content_block_start", "tool_use"),
            ("content_block_delta", "input_json_delta"),
            ("content_block_stop", None),
            ("content_block_start", "tool_use"),
            ("content_block_delta", "input_json_delta"),
            ("content_block_stop", None),
            ("message_delta", None),
            ("message_stop", None),
        ]

    def test_the_sdk_accumulates_the_whole_message(self):
        adapter = TypeAdapter(RawMessageStreamEvent)
        snapshot, buffers = None, {}
        for event in events_of(STREAM):
            if event["type"] != "ping":
                event = adapter.validate_python(event)
                snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=buffers)
        assert [block.type for block in snapshot.content] == ["thinking", "text", "tool_use", "tool_use"]
        assert snapshot.content[0].thinking == "Let me think."
        assert decode_reasoning(snapshot.content[0].signature) == "Let me think."
        assert snapshot.content[2].input == {"a": 1} and snapshot.content[3].input == {}
        assert snapshot.stop_reason == "tool_use"
        assert (snapshot.usage.input_tokens, snapshot.usage.cache_read_input_tokens) == (8, 4)
        assert snapshot.usage.output_tokens == 9

    def test_stop_sequence(self):
        chunks = [_chunk({"content": "a"}), _chunk(finish="stop", stop_reason="END")]
        last = events_of(
            chunks,
        )[-2]
        assert last["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}  # not one of the request's
        events = MessageEvents(MessageShape("m", omit_thinking=False, stop_sequences=["END"]), prompt_tokens=1)

        async def collect():
            return [event async for event in events.events(_chunks(chunks))]

        assert asyncio.run(collect())[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}

    def test_pings_while_the_first_chunk_is_awaited(self):
        async def slow():
            await asyncio.sleep(0.35)
            yield {"first": True}
            yield {"second": True}

        async def collect():
            return [item async for item in pinged(slow(), interval=0.1)]

        items = asyncio.run(collect())
        assert items[-2:] == [{"first": True}, {"second": True}]
        assert items[:-2] and all(item is PING for item in items[:-2])


class TestErrors:
    @pytest.mark.parametrize(
        "error,status,kind",
        [
            (InvalidRequestError("x"), 400, "invalid_request_error"),
            (AuthenticationError("x"), 401, "authentication_error"),
            (ModelNotFoundError("x"), 404, "not_found_error"),
            (PayloadTooLargeError("x"), 413, "request_too_large"),
            (EngineBusyError("x"), 429, "rate_limit_error"),
            (EngineUnavailableError("x"), 529, "overloaded_error"),
        ],
    )
    def test_anthropic_shape(self, error, status, kind):
        assert anthropic_error(error, "req_1") == (
            status,
            {"type": "error", "error": {"type": kind, "message": "x"}, "request_id": "req_1"},
        )


def test_encoded_reasoning_round_trips():
    assert decode_reasoning(encode_reasoning("é\n")) == "é\n" and decode_reasoning("sig-abc") is None
    assert json.loads(json.dumps(encode_reasoning("x")))


def test_an_error_after_the_stream_began_is_an_error_event():
    from deltafin.serving.context import RequestStats
    from deltafin.serving.messages.service import _framer

    async def failing():
        yield _chunk({"content": "Hel"})
        raise EngineBusyError("the engine is busy")

    closed = []
    stats = RequestStats(prompt_tokens=3)
    frame = _framer(MessageShape("m", omit_thinking=False, stop_sequences=None), stats)

    async def collect():
        return b"".join([part async for part in frame(failing(), lambda error: error, lambda: closed.append(1))])

    body = asyncio.run(collect()).decode()
    names = re.findall(r"^event: (\S+)$", body, re.M)
    assert names == ["message_start", "ping", "content_block_start", "content_block_delta", "error"]
    error = json.loads(body.rsplit("data: ", 1)[1])
    assert error == {"type": "error", "error": {"type": "rate_limit_error", "message": "the engine is busy"}}
    assert closed == [1]  # the generation is stopped however the body ends
