"""Which constraint a chat request gets (deltafin.serving.chat_constraint), rules first."""

from __future__ import annotations

import json

import msgspec
import pytest
import xgrammar as xgr

from deltafin.errors import InvalidRequestError
from deltafin.families import bind_family
from deltafin.grammar.constraints import grammar_of
from deltafin.protocol.chat import ChatCompletionRequest
from deltafin.rules import RuleContext
from deltafin.rules.force_tool_choice_auto import ForceToolChoiceAuto
from deltafin.rules.tool_choice_required_to_auto import ToolChoiceRequiredToAuto
from deltafin.serving.chat_constraint import request_constraint
from tests.conftest import tiny_config

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}, "required": ["b", "a"]}
K3_THINKING = '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
K3_NO_THINKING = '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'


def bound(model):
    return bind_family(model.family, model.variant)


def chat(**fields) -> ChatCompletionRequest:
    return msgspec.convert({"messages": [{"role": "user", "content": "hi"}], **fields}, ChatCompletionRequest)


def accepts(constraint, text: str) -> bool:
    matcher = xgr.GrammarMatcher(
        xgr.GrammarCompiler(xgr.TokenizerInfo([chr(c) for c in range(32, 127)])).compile_grammar(grammar_of(constraint))
    )
    return matcher.accept_string(text) and matcher.is_completed()


class TestResponseFormat:
    def test_json_schema_keeps_the_schema_property_order(self, config):
        constraint, field = request_constraint(
            chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}),
            bound(config.model),
            "",
        )
        assert (constraint.kind, field) == ("json_schema", "response_format")
        assert list(json.loads(constraint.value)["properties"]) == ["b", "a"]

    def test_json_object_and_text(self, config):
        assert (
            request_constraint(chat(response_format={"type": "json_object"}), bound(config.model), "")[0].kind
            == "json_object"
        )
        assert request_constraint(chat(response_format={"type": "text"}), bound(config.model), "") is None
        assert request_constraint(chat(), bound(config.model), "") is None

    def test_on_a_reasoning_model_the_json_comes_after_the_reasoning(self):
        model = bound(tiny_config("kimi_k3", "unused").model)
        constraint, _ = request_constraint(chat(response_format={"type": "json_object"}), model, K3_THINKING)
        assert constraint.kind == "structural_tag"
        assert accepts(
            constraint,
            'Hmm.<|close|>think<|sep|><|open|>response<|sep|>{"a": 1}<|close|>response<|sep|><|close|>message<|sep|>',
        )
        assert not accepts(constraint, '{"a": 1}')

    def test_with_reasoning_off_the_answer_is_json_from_the_first_token(self):
        model = bound(tiny_config("kimi_k3", "unused").model)
        constraint, _ = request_constraint(chat(response_format={"type": "json_object"}), model, K3_NO_THINKING)
        assert constraint.kind == "json_object"


class TestToolChoice:
    @pytest.fixture
    def glm(self):
        return bound(tiny_config("glm47", "unused").model)

    def test_named_function_is_forced_and_wins_over_response_format(self, glm):
        request = chat(
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            response_format={"type": "json_object"},
        )
        constraint, field = request_constraint(request, glm, "<think></think>")
        assert field == "tool_choice" and accepts(
            constraint, "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"
        )

    def test_auto_and_none_force_nothing(self, glm):
        assert request_constraint(chat(tools=[WEATHER], tool_choice="auto"), glm, "") is None
        assert request_constraint(chat(tools=[WEATHER], tool_choice="none"), glm, "") is None

    def test_a_named_function_not_in_tools_is_400(self, glm):
        with pytest.raises(InvalidRequestError) as caught:
            request_constraint(
                chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), glm, ""
            )
        assert caught.value.param == "tool_choice"

    @pytest.mark.parametrize("rule", [ForceToolChoiceAuto(), ToolChoiceRequiredToAuto()])
    def test_rules_rewrite_before_enforcement(self, glm, rule):
        request = chat(tools=[WEATHER], tool_choice="required")
        assert request_constraint(request, glm, "") is not None  # without the rule: enforced
        rewritten = rule.request(request, RuleContext(family="glm", endpoint="chat", context_length=4096))
        assert request_constraint(rewritten, glm, "") is None


def test_the_constraint_is_part_of_the_memo_key():
    from deltafin.engine import GenerationJob
    from deltafin.engine.memo import ResponseMemo
    from deltafin.grammar.constraints import json_object, json_schema
    from deltafin.protocol.sampling import SamplingParams

    memo = ResponseMemo(8)
    free = GenerationJob((1, 2, 3), SamplingParams(max_tokens=4, temperature=0.0))
    memo.put(free, ["free"])
    for constraint in (json_object(), json_schema(SCHEMA)):
        constrained = GenerationJob((1, 2, 3), SamplingParams(max_tokens=4, temperature=0.0, constraint=constraint))
        assert memo.get(constrained) is None
    memo.put(
        GenerationJob((1, 2, 3), SamplingParams(max_tokens=4, temperature=0.0, constraint=json_object())), ["json"]
    )
    assert memo.get(
        GenerationJob((1, 2, 3), SamplingParams(max_tokens=4, temperature=0.0, constraint=json_object()))
    ) == ("json",)
