"""The Responses API end to end on the default model: `python -m deltafin`, the official openai client, every
object and event parsed strictly by the SDK's own models. Forced tool calls on this parser-less model through
instructor's TOOLS mode and `.parse()` with tools; /v1/completions with a list of prompts."""

from __future__ import annotations

import json

import httpx
import instructor
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseItem, ResponseStreamEvent

pytestmark = pytest.mark.e2e

EVENT = pydantic.TypeAdapter(ResponseStreamEvent)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather for a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Rome"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}


class Person(pydantic.BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def client(live_server):
    return openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def strict(body: dict) -> Response:
    """The SDK's own model, validated (the client itself builds its objects without validation)."""
    return Response.model_validate(body)


def sse_events(live_server, body: dict) -> list[dict]:
    """The raw event stream: each `event:` line names its data's type; every event parses with the SDK."""
    events = []
    with httpx.stream("POST", f"{live_server.base_url}/v1/responses", json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                assert event["type"] == name
                EVENT.validate_python(event)
                events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


class TestCreateRetrieveDelete:
    def test_create_retrieve_list_inputs_delete(self, client):
        response = client.responses.create(
            model="smollm2",
            instructions="Answer briefly.",
            input="Say hello.",
            max_output_tokens=12,
            temperature=0,
            metadata={"k": "v"},
        )
        raw = client.responses.with_raw_response.retrieve(response.id)
        again = strict(raw.http_response.json())
        assert again.id == response.id and again.output_text == response.output_text and response.output_text
        assert response.status in ("completed", "incomplete") and response.metadata == {"k": "v"}
        assert 0 < response.usage.output_tokens <= 12 and response.usage.input_tokens > 0
        assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
        items = client.responses.input_items.list(response.id)
        assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "Say hello.")]
        for item in items.data:
            pydantic.TypeAdapter(ResponseItem).validate_python(item.model_dump(mode="json", exclude_unset=True))
        client.responses.delete(response.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(response.id)

    def test_a_length_cut_is_incomplete_with_its_reason(self, client):
        response = client.responses.create(
            model="smollm2", input="Write a long story.", max_output_tokens=3, temperature=0
        )
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
        assert response.usage.output_tokens == 3

    def test_store_false_keeps_nothing(self, client):
        response = client.responses.create(model="smollm2", input="Hi", max_output_tokens=2, store=False)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(response.id)

    def test_previous_response_id_continues_the_conversation(self, client):
        first = client.responses.create(
            model="smollm2", input="My name is Ada. Say OK.", max_output_tokens=8, temperature=0
        )
        second = client.responses.create(
            model="smollm2", input="What is my name?", previous_response_id=first.id, max_output_tokens=8, temperature=0
        )
        # The whole first exchange is in the second prompt: its input is longer than the first one's total.
        assert second.usage.input_tokens > first.usage.total_tokens and second.previous_response_id == first.id
        with pytest.raises(openai.NotFoundError) as caught:
            client.responses.create(model="smollm2", input="x", previous_response_id="resp_nope")
        assert caught.value.body["param"] == "previous_response_id"

    def test_unsupported_fields_are_400_by_name(self, client):
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(model="smollm2", input="x", background=True)
        assert caught.value.body["param"] == "background"
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(
                model="smollm2",
                input=[
                    {"role": "user", "content": [{"type": "input_image", "image_url": "https://example.invalid/a.png"}]}
                ],
            )
        assert caught.value.body["param"] == "input[0].content[0].type"


class TestStreaming:
    def test_the_event_sequence_parses_and_ends_with_the_stored_response(self, client, live_server):
        events = sse_events(
            live_server, {"model": "smollm2", "input": "Count to three.", "max_output_tokens": 10, "temperature": 0}
        )
        kinds = [e["type"] for e in events]
        assert kinds[:4] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
        ]
        assert kinds[-4:] == [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.incomplete" if events[-1]["response"]["status"] == "incomplete" else "response.completed",
        ]
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        final = Response.model_validate(events[-1]["response"])
        assert final.output_text == text and text
        assert client.responses.retrieve(final.id).output_text == text

    def test_the_sdk_stream_helper_collects_the_same_text(self, client):
        with client.responses.stream(model="smollm2", input="Say hi.", max_output_tokens=6, temperature=0) as stream:
            events = list(stream)
        deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
        # A cut answer ends with response.incomplete, as OpenAI's does (the helper's get_final_response wants
        # response.completed): the last event carries the whole response either way.
        assert events[-1].type in ("response.completed", "response.incomplete")
        assert events[-1].response.output_text == "".join(deltas)


class TestStructuredAndForcedCalls:
    def test_text_format_with_the_sdks_parse(self, client):
        response = client.responses.parse(
            model="smollm2",
            input="Ada is 36. Describe her in JSON.",
            text_format=Person,
            temperature=0,
            max_output_tokens=60,
        )
        assert isinstance(response.output_parsed, Person)

    def test_a_named_tool_choice_yields_that_call_on_a_model_without_a_tool_parser(self, client, live_server):
        response = client.responses.create(
            model="smollm2",
            input="Weather in Rome for 2 days?",
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"},
            temperature=0,
            max_output_tokens=60,
        )
        [call] = response.output
        assert call.type == "function_call" and call.name == "get_weather" and call.call_id
        arguments = json.loads(call.arguments)
        assert arguments["city"] in ("Paris", "Rome") and 1 <= arguments["days"] <= 7
        events = sse_events(
            live_server,
            {
                "model": "smollm2",
                "input": "Weather?",
                "tools": [WEATHER],
                "tool_choice": "required",
                "parallel_tool_calls": False,
                "temperature": 0,
                "max_output_tokens": 60,
            },
        )
        streamed = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
        [done] = [e for e in events if e["type"] == "response.function_call_arguments.done"]
        assert done["arguments"] == streamed and json.loads(streamed)["city"] in ("Paris", "Rome")

    def test_tools_with_auto_stay_a_400_on_a_model_without_a_tool_parser(self, client):
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(model="smollm2", input="x", tools=[WEATHER])
        assert caught.value.body["param"] == "tools"

    def test_instructor_tools_mode(self, client):
        patched = instructor.from_openai(client, mode=instructor.Mode.TOOLS)
        person = patched.chat.completions.create(
            model="smollm2",
            response_model=Person,
            temperature=0,
            max_tokens=60,
            messages=[{"role": "user", "content": "John is 30 years old."}],
            max_retries=0,
        )
        assert isinstance(person, Person)

    def test_chat_parse_with_a_pydantic_function_tool(self, client):
        completion = client.chat.completions.parse(
            model="smollm2",
            messages=[{"role": "user", "content": "John is 30 years old."}],
            temperature=0,
            # parallel_tool_calls false: exactly one call (with calls unbounded a small model may not close the array)
            tools=[openai.pydantic_function_tool(Person)],
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=60,
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert isinstance(choice.message.tool_calls[0].function.parsed_arguments, Person)

    def test_required_among_several_tools_streams_tool_call_deltas(self, client):
        # parallel_tool_calls false: an array of exactly one call (a small model may not close a longer array).
        time_tool = {
            "type": "function",
            "function": {
                "name": "get_time",
                "parameters": {
                    "type": "object",
                    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                    "required": ["zone"],
                },
            },
        }
        weather = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
        stream = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "Time?"}],
            tools=[weather, time_tool],
            tool_choice="required",
            temperature=0,
            parallel_tool_calls=False,
            max_tokens=120,
            stream=True,
        )
        calls: dict[int, dict] = {}
        finish = None
        for chunk in stream:
            for call in chunk.choices[0].delta.tool_calls or ():
                entry = calls.setdefault(call.index, {"name": call.function.name, "arguments": ""})
                entry["arguments"] += call.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls" and len(calls) == 1
        for entry in calls.values():
            assert entry["name"] in ("get_weather", "get_time") and isinstance(json.loads(entry["arguments"]), dict)


class TestCompletionPrompts:
    def test_a_list_of_prompts_answers_n_choices_per_prompt_in_prompt_major_order(self, client):
        prompts = ["The capital of France is", "One, two,"]
        singles = [
            client.completions.create(model="smollm2", prompt=p, max_tokens=4, temperature=0).choices[0].text
            for p in prompts
        ]
        batch = client.completions.create(model="smollm2", prompt=prompts, n=2, max_tokens=4, temperature=0)
        assert [c.index for c in batch.choices] == [0, 1, 2, 3]
        assert [c.text for c in batch.choices] == [singles[0], singles[0], singles[1], singles[1]]
        ids = client.completions.create(model="smollm2", prompt=[[504, 3575], [504]], max_tokens=2, temperature=0)
        assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 3
