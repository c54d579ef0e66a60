"""The official `anthropic` SDK against `python -m deltafin` (the shared local server, tests/shared_server.py):
messages.create and messages.stream on the default model, count_tokens, forced tool use, errors read as the SDK's
own exception types; on every family's taught model (tests/e2e/test_families.py) a tool call with its thinking
block, streamed and whole, and the tool round trip after it."""

from __future__ import annotations

import re

import anthropic
import pytest

from tests.conftest import TINY_FAMILIES
from tests.e2e.test_families import ARGUMENTS, KIMI_ID, QUESTION, TAUGHT, TOOLS
from tests.serving.test_messages_prompts import WEATHER

pytestmark = pytest.mark.e2e

MAIN = "smollm2"  # the main model's alias
#: greedy: the SDK's 1.x+ types dropped `temperature`, which the API (and Deltafin) still take
GREEDY = {"extra_body": {"temperature": 0}}


def client_for(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)


def ask(text: str = "Say hi.") -> list[dict]:
    return [{"role": "user", "content": text}]


class TestDefaultModel:
    def test_create(self, live_server):
        message = client_for(live_server).messages.create(model=MAIN, max_tokens=5, messages=ask(), **GREEDY)
        assert message.type == "message" and message.model == MAIN and message.id.startswith("msg_")
        assert message.content[0].type == "text" and message.content[0].text
        assert message.stop_reason in ("end_turn", "max_tokens") and 0 < message.usage.output_tokens <= 5
        assert message._request_id.startswith("req_")

    def test_stream_gives_the_same_greedy_answer(self, live_server):
        client = client_for(live_server)
        whole = client.messages.create(model=MAIN, max_tokens=8, messages=ask("Name a colour."), **GREEDY)
        with client.messages.stream(model=MAIN, max_tokens=8, messages=ask("Name a colour."), **GREEDY) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert text == final.content[0].text == whole.content[0].text
        assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens

    def test_beta_client_and_count_tokens(self, live_server):
        client = client_for(live_server)
        counted = client.beta.messages.count_tokens(model=MAIN, messages=ask("Count me."), system="Be brief.")
        made = client.beta.messages.create(model=MAIN, max_tokens=1, messages=ask("Count me."), system="Be brief.")
        assert counted.input_tokens == made.usage.input_tokens + (made.usage.cache_read_input_tokens or 0)

    @pytest.mark.parametrize(
        "choice", [{"type": "tool", "name": "get_weather"}, {"type": "any", "disable_parallel_tool_use": True}]
    )
    def test_forced_tool_use_is_schema_valid(self, live_server, choice):
        """The default model has no tool-call syntax: the call is forced as JSON under the tool's schema."""
        message = client_for(live_server).messages.create(
            model=MAIN, max_tokens=60, messages=ask("Weather in Paris?"), tools=[WEATHER], tool_choice=choice
        )
        (call,) = [block for block in message.content if block.type == "tool_use"]
        assert call.name == "get_weather" and message.stop_reason == "tool_use"
        # under the schema: an object of its properties only, a string city and an integer days where present
        assert set(call.input) <= {"city", "days"}
        assert isinstance(call.input.get("city", ""), str) and type(call.input.get("days", 0)) is int

    def test_errors_are_the_sdks_types(self, live_server):
        client = client_for(live_server)
        with pytest.raises(anthropic.NotFoundError) as info:
            client.messages.create(model="gpt-none", max_tokens=1, messages=ask())
        assert info.value.body["error"]["type"] == "not_found_error"
        with pytest.raises(anthropic.BadRequestError) as info:
            client.messages.create(model=MAIN, max_tokens=1, messages=ask("hi " * 9000))
        assert re.fullmatch(r"prompt is too long: \d+ tokens > 8191 maximum", info.value.body["error"]["message"])
        with pytest.raises(anthropic.BadRequestError, match="text only"):
            image = {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1/x.png"}}
            client.messages.create(model=MAIN, max_tokens=1, messages=[{"role": "user", "content": [image]}])


@pytest.fixture(scope="module", params=TINY_FAMILIES)
def taught(request, local_server):
    """(family, a client, the name its taught model is served as)."""
    return request.param, client_for(local_server), TAUGHT[request.param].name


class TestFamilies:
    """The taught models answer the scripted question with reasoning and a call, and the result with an answer."""

    def ask_weather(self, client, model, **fields):
        return dict(
            model=model,
            max_tokens=200,
            messages=QUESTION,
            tools=[WEATHER],
            thinking={"type": "enabled", "budget_tokens": 1024},
            **GREEDY,
            **fields,
        )

    def test_thinking_and_tool_use_then_the_round_trip(self, taught):
        family, client, model = taught
        message = client.messages.create(**self.ask_weather(client, model))
        assert [block.type for block in message.content] == ["thinking", "tool_use"], message
        thinking, call = message.content
        assert thinking.thinking == "Weather needed." and thinking.signature
        assert (call.name, call.input, message.stop_reason) == ("get_weather", ARGUMENTS, "tool_use")
        if family.startswith("kimi"):
            assert call.id == KIMI_ID  # the id Kimi's prompt renders back
        follow = self.ask_weather(client, model)
        follow["messages"] = [
            *QUESTION,
            {"role": "assistant", "content": [call.model_dump(exclude_none=True)]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21 C"}]},
        ]
        answer = client.messages.create(**follow)
        assert [block.type for block in answer.content] == ["thinking", "text"], answer
        assert answer.content[0].thinking == "Fine." and answer.content[1].text == "Sunny in Paris."
        assert answer.stop_reason == "end_turn"

    def test_the_stream_accumulates_to_the_same_message(self, taught):
        family, client, model = taught
        whole = client.messages.create(**self.ask_weather(client, model))
        with client.messages.stream(**self.ask_weather(client, model)) as stream:
            kinds = [event.type for event in stream]
            final = stream.get_final_message()
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
        assert [block.model_dump(exclude={"id", "signature"}) for block in final.content] == [
            block.model_dump(exclude={"id", "signature"}) for block in whole.content
        ]
        assert final.content[0].signature == whole.content[0].signature
        assert final.stop_reason == "tool_use" and final.usage.output_tokens == whole.usage.output_tokens

    def test_omitted_thinking_comes_back_through_its_signature(self, taught):
        """`display: "omitted"` (Claude Code's): the text is empty, and the signature carries it back in history:
        the prompt counts as it does with the reasoning sent in the clear."""
        family, client, model = taught
        thinking = {"type": "enabled", "budget_tokens": 1024, "display": "omitted"}
        message = client.messages.create(**{**self.ask_weather(client, model), "thinking": thinking})
        block, call = message.content
        assert block.type == "thinking" and block.thinking == "" and block.signature

        def history(thought: dict) -> list[dict]:
            result = {"type": "tool_result", "tool_use_id": call.id, "content": "x"}
            assistant = {"role": "assistant", "content": [thought, call.model_dump(exclude_none=True)]}
            return [*QUESTION, assistant, {"role": "user", "content": [result]}]

        def count(thought: dict) -> int:
            return client.messages.count_tokens(model=model, tools=[WEATHER], messages=history(thought)).input_tokens

        clear = {"type": "thinking", "thinking": "Weather needed.", "signature": ""}
        unrelated = {"type": "thinking", "thinking": "Something else entirely, at length.", "signature": ""}
        assert count(block.model_dump()) == count(clear)
        if family == "kimi_k3":  # a format that keeps the reasoning in history: a different thought counts
            assert count(unrelated) != count(clear)


def test_tools_fixture_matches_the_chat_script():
    assert WEATHER["input_schema"] == TOOLS[0]["function"]["parameters"]
