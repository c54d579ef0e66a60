"""Structured outputs end to end: the real server (the shared local one, tests/shared_server.py), the official
openai client.

The default model: `.parse()` with a pydantic model, json_object, a streamed json_schema. Every tiny family
(random weights, thinking off; served as `thinkless-FAMILY`): a named tool_choice yields that call although the
same model, unconstrained, calls nothing; "required" with several tools yields a call. The calls come back
through each family's own parser, so the grammar wrote the family's native syntax."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pydantic
import pytest

from deltafin.tiny import write_tiny_model
from tests.conftest import TINY_FAMILIES, TINY_OVERRIDES, TINY_SPECS, LiveServer, tiny_config
from tests.grammar.tools import TIME, WEATHER
from tests.shared_server import shared_model

pytestmark = pytest.mark.e2e


class Person(pydantic.BaseModel):
    name: str
    age: int
    languages: list[str] = pydantic.Field(max_length=3)


def openai_client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def client(live_server):
    return openai_client(live_server)


class TestDefaultModel:
    def test_parse_with_a_pydantic_model_returns_a_parsed_object(self, client):
        completion = client.chat.completions.parse(
            model="smollm2",
            messages=user("Describe a programmer called Ada in JSON."),
            response_format=Person,
            temperature=0,
            max_tokens=200,
        )
        person = completion.choices[0].message.parsed
        assert isinstance(person, Person) and completion.choices[0].finish_reason == "stop"

    def test_json_object_output_parses(self, client):
        response = client.chat.completions.create(
            model="smollm2",
            messages=user("What is the capital of France? Answer in JSON."),
            response_format={"type": "json_object"},
            temperature=0,
            max_tokens=100,
        )
        assert isinstance(json.loads(response.choices[0].message.content), dict)

    def test_streamed_json_schema_is_valid_when_joined(self, client):
        stream = client.chat.completions.create(
            model="smollm2",
            messages=user("Describe a programmer called Ada in JSON."),
            stream=True,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": Person.model_json_schema(), "strict": True},
            },
            temperature=0,
            max_tokens=200,
        )
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        Person.model_validate_json(text)

    def test_bogus_response_format_is_400(self, client):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="smollm2", messages=user("hi"), response_format={"type": "bogus"})
        assert caught.value.body["param"] == "response_format.type"

    def test_tools_on_a_model_without_a_tool_parser_is_400(self, client):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="smollm2", messages=user("hi"), tools=[WEATHER])
        assert caught.value.body["param"] == "tools"

    def test_embeddings_is_404_saying_what_is_served(self, client):
        with pytest.raises(openai.NotFoundError) as caught:
            client.embeddings.create(model="smollm2", input="hi")
        assert "/v1/chat/completions" in caught.value.body["message"]


def thinkless_entry(family: str):
    def prepare(root: Path) -> tuple[Path, list[str]]:
        name, variant = TINY_SPECS[family]
        path = write_tiny_model(name, root / "model", variant=variant)
        kwarg = tiny_config(family, path).model.thinking_kwarg
        return path, [*TINY_OVERRIDES[family], f"model.path={path}", f"model.chat_template_kwargs.{kwarg}=false"]

    return prepare


#: family -> its untaught tiny model with thinking off, an entry of the shared local server
THINKLESS = {family: shared_model(f"thinkless-{family}", thinkless_entry(family)) for family in TINY_FAMILIES}


@pytest.fixture(scope="module", params=TINY_FAMILIES)
def tiny_server(request, local_server):
    """(family, a client of the shared server, the name the family's model is served as)."""
    family = request.param
    return family, openai_client(local_server), THINKLESS[family].name


def calls_of(response) -> list[tuple[str, dict]]:
    message = response.choices[0].message
    return [(call.function.name, json.loads(call.function.arguments)) for call in message.tool_calls or ()]


class TestEnforcedToolChoice:
    def test_named_choice_yields_that_call_where_auto_yields_none(self, tiny_server):
        family, client, model = tiny_server
        ask = dict(
            model=model, messages=user("Weather in Paris?"), tools=[WEATHER, TIME], temperature=0, max_tokens=400
        )
        # Unconstrained, a random model writes until max_tokens: 64 tokens show it starts no call (a call's
        # markup opens its answer when the grammar forces one).
        free = client.chat.completions.create(**{**ask, "max_tokens": 64}, tool_choice="auto")
        assert calls_of(free) == [], f"{family}: the tiny model calls unconstrained; the test would prove nothing"
        forced = client.chat.completions.create(
            **ask, tool_choice={"type": "function", "function": {"name": "get_weather"}}
        )
        [(name, args)] = calls_of(forced)
        assert name == "get_weather" and args["city"] in ("Paris", "Rome") and 1 <= args["days"] <= 7
        assert forced.choices[0].finish_reason == "tool_calls"

    def test_required_with_several_tools_yields_a_call(self, tiny_server):
        family, client, model = tiny_server
        response = client.chat.completions.create(
            model=model,
            messages=user("What now?"),
            tools=[WEATHER, TIME],
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=400,
        )
        [(name, _)] = calls_of(response)
        assert name in ("get_weather", "get_time")
