"""The request plan (deltafin.serving.plan): the one completion budget of every API, and tool use decided once."""

import msgspec
import pytest

from deltafin.errors import ContextLengthError, InvalidRequestError
from deltafin.families import bind_family
from deltafin.prompt import RenderedPrompt
from deltafin.protocol.chat import ChatCompletionRequest
from deltafin.serving.chat_constraint import tool_use
from deltafin.serving.plan import Budget, plan_chat, token_budget

WEATHER = {
    "type": "function",
    "function": {"name": "w", "parameters": {"type": "object", "properties": {"c": {"type": "string"}}}},
}


def chat(**fields) -> ChatCompletionRequest:
    return msgspec.convert({"messages": [{"role": "user", "content": "hi"}], **fields}, ChatCompletionRequest)


class TestTokenBudget:
    def test_nothing_named_runs_to_the_end_of_the_context(self):
        assert token_budget(100, 30, Budget(None)) == 70

    def test_a_default_is_bounded_by_the_room_left(self):
        assert token_budget(100, 30, Budget(None, default=50)) == 50
        assert token_budget(100, 90, Budget(None, default=50)) == 10

    def test_an_explicit_value_is_honoured_or_refused(self):
        assert token_budget(100, 30, Budget(70)) == 70
        with pytest.raises(ContextLengthError) as info:
            token_budget(100, 30, Budget(71, param="max_completion_tokens"))
        assert "you requested 101 tokens (30 in the input, 71 in the completion)" in info.value.message
        assert info.value.param == "max_completion_tokens"

    def test_fit_cuts_an_explicit_value_to_the_room(self):
        assert token_budget(100, 30, Budget(32000, fit=True)) == 70
        assert token_budget(100, 30, Budget(5, fit=True)) == 5

    @pytest.mark.parametrize("fit", [False, True])
    def test_a_prompt_that_fills_the_context_is_refused(self, fit):
        with pytest.raises(ContextLengthError) as info:
            token_budget(100, 100, Budget(1, fit=fit))
        assert (info.value.prompt_tokens, info.value.context_length) == (100, 100)
        assert "your request has 100 input tokens" in info.value.message


class TestToolUse:
    def test_a_family_with_a_parser_reads_calls(self):
        glm = bind_family("glm", "glm47")
        assert tool_use(chat(tools=[WEATHER]), glm, "m").calls_allowed
        assert not tool_use(chat(tools=[WEATHER], tool_choice="none"), glm, "m").calls_allowed

    def test_a_family_without_a_parser_forces_json_or_refuses(self):
        generic = bind_family("generic")
        forced = tool_use(chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False), generic, "m")
        assert forced.forced_json is not None and forced.forced_json.single
        with pytest.raises(InvalidRequestError) as info:
            tool_use(chat(tools=[WEATHER]), generic, "m")
        assert info.value.param == "tools" and "`m`" in info.value.message

    def test_a_forced_choice_needs_tools(self):
        with pytest.raises(InvalidRequestError) as info:
            tool_use(chat(tool_choice="required"), bind_family("glm"), "m")
        assert info.value.param == "tool_choice"


def test_plan_holds_the_budget_and_the_constraint():
    family = bind_family("generic")
    request = chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "w"}})
    plan = plan_chat(
        request,
        family,
        tool_use(request, family, "m"),
        RenderedPrompt([1, 2, 3], "abc"),
        context_length=10,
        budget=Budget(None, default=4),
    )
    assert plan.max_tokens == 4
    assert plan.constraint is not None and plan.constraint[1] == "tool_choice"
    with pytest.raises(InvalidRequestError, match="empty prompt"):
        plan_chat(request, family, plan.tools, RenderedPrompt([], ""), context_length=10, budget=Budget(None))
