"""One class per rule: literal request in, literal request (or response, or error) out."""

import asyncio

import msgspec
import pytest

from deltafin.errors import ContextLengthError, EngineBusyError, PayloadTooLargeError
from deltafin.protocol.chat import ChatCompletionRequest
from deltafin.protocol.completions import CompletionRequest
from deltafin.rules import RuleContext
from deltafin.rules.chat_default_max_tokens import ChatDefaultMaxTokens
from deltafin.rules.context_overflow_status import ContextOverflowStatus
from deltafin.rules.flatten_tool_text import FlattenToolText
from deltafin.rules.force_tool_choice_auto import ForceToolChoiceAuto
from deltafin.rules.kimi_thinking import KimiThinking
from deltafin.rules.max_tokens_cap import MaxTokensCap
from deltafin.rules.reasoning_usage import ReasoningUsage
from deltafin.rules.sampling_pins import SamplingPins
from deltafin.rules.tool_choice_required_to_auto import ToolChoiceRequiredToAuto

CTX = RuleContext(family="glm", endpoint="chat", context_length=8192)


def chat(**fields) -> ChatCompletionRequest:
    return msgspec.convert({"messages": [{"role": "user", "content": "hi"}], **fields}, ChatCompletionRequest)


def completion(**fields) -> CompletionRequest:
    return msgspec.convert({"prompt": "hi", **fields}, CompletionRequest)


def as_dict(request) -> dict:
    return msgspec.to_builtins(request)


class TestChatDefaultMaxTokens:
    """Sets a default only where the client named no max tokens."""

    def test_sets_the_default_when_none_given(self):
        request = chat()
        assert ChatDefaultMaxTokens(32768).default_max_tokens(None, request, CTX) == 32768
        assert ChatDefaultMaxTokens(32768).request(request, CTX) is request  # the request itself is left as sent

    def test_leaves_completions_alone(self):
        assert ChatDefaultMaxTokens(32768).default_max_tokens(256, completion(), CTX) == 256

    def test_rejects_a_nonpositive_value(self):
        with pytest.raises(ValueError):
            ChatDefaultMaxTokens(0)


class TestMaxTokensCap:
    """Bounds explicit and default max tokens; 0 is off."""

    def test_lowers_an_explicit_value(self):
        assert MaxTokensCap(100).request(chat(max_tokens=500), CTX).max_tokens == 100

    def test_lowers_max_completion_tokens(self):
        assert MaxTokensCap(100).request(chat(max_completion_tokens=500), CTX).max_completion_tokens == 100

    def test_bounds_the_default(self):
        assert MaxTokensCap(100).default_max_tokens(None, chat(), CTX) == 100  # chat's run-to-EOS
        assert MaxTokensCap(100).default_max_tokens(256, completion(), CTX) == 100
        assert MaxTokensCap(100).default_max_tokens(32768, chat(), CTX) == 100  # an earlier rule's

    def test_never_raises_a_default(self):
        assert MaxTokensCap(1000).default_max_tokens(256, completion(), CTX) == 256

    def test_leaves_values_under_the_cap_alone(self):
        request = completion(max_tokens=50)
        assert MaxTokensCap(100).request(request, CTX) is request

    def test_zero_is_off(self):
        request = chat(max_tokens=10**6)
        assert MaxTokensCap(0).request(request, CTX) is request
        assert MaxTokensCap(0).default_max_tokens(None, chat(), CTX) is None


class TestForceToolChoiceAuto:
    @pytest.mark.parametrize("choice", ["none", "required", {"type": "function", "function": {"name": "f"}}])
    def test_serves_any_explicit_choice_as_auto(self, choice):
        assert ForceToolChoiceAuto().request(chat(tool_choice=choice), CTX).tool_choice == "auto"

    @pytest.mark.parametrize("choice", [None, "auto"])
    def test_leaves_absent_and_auto_alone(self, choice):
        request = chat(tool_choice=choice)
        assert ForceToolChoiceAuto().request(request, CTX) is request


class TestToolChoiceRequiredToAuto:
    def test_required_becomes_auto(self):
        assert ToolChoiceRequiredToAuto().request(chat(tool_choice="required"), CTX).tool_choice == "auto"

    @pytest.mark.parametrize("choice", [None, "none", "auto", {"type": "function", "function": {"name": "f"}}])
    def test_other_choices_stay(self, choice):
        request = chat(tool_choice=choice)
        assert ToolChoiceRequiredToAuto().request(request, CTX) is request


class TestKimiThinking:
    def test_enabled_maps_to_true(self):
        out = KimiThinking().request(chat(thinking={"type": "enabled"}), CTX)
        assert out.chat_template_kwargs == {"thinking": True}

    def test_disabled_maps_to_false(self):
        out = KimiThinking().request(chat(thinking={"type": "disabled"}, chat_template_kwargs={"x": 1}), CTX)
        assert out.chat_template_kwargs == {"x": 1, "thinking": False}

    def test_absent_field_is_left_alone(self):
        request = chat()
        assert KimiThinking().request(request, CTX) is request

    def test_explicit_template_kwarg_wins(self):
        request = chat(thinking={"type": "enabled"}, chat_template_kwargs={"thinking": False})
        assert KimiThinking().request(request, CTX) is request

    def test_malformed_thinking_is_400(self):
        with pytest.raises(Exception) as info:
            KimiThinking().request(chat(thinking={"kind": 1}), CTX)
        assert info.value.status == 400 and info.value.param == "thinking"


class TestSamplingPins:
    PINS = dict(top_p=0.95, presence_penalty=0.0, frequency_penalty=0.0, n=1)

    def test_overrides_what_the_client_sent(self):
        out = SamplingPins(**self.PINS).request(chat(top_p=0.5, presence_penalty=1.0, n=3), CTX)
        assert (out.top_p, out.presence_penalty, out.frequency_penalty, out.n) == (0.95, 0.0, 0.0, 1)

    def test_fills_omitted_fields(self):
        out = SamplingPins(**self.PINS).request(chat(), CTX)
        assert out.top_p == 0.95 and out.frequency_penalty == 0.0

    def test_already_pinned_request_is_left_alone(self):
        request = chat(top_p=0.95, presence_penalty=0, frequency_penalty=0, n=1)
        assert SamplingPins(**self.PINS).request(request, CTX) is request

    def test_unknown_field_is_a_config_error(self):
        with pytest.raises(ValueError, match="cannot pin"):
            SamplingPins(model="x")


class TestFlattenToolText:
    def request(self, content):
        return chat(
            messages=[{"role": "user", "content": "q"}, {"role": "tool", "tool_call_id": "c1", "content": content}]
        )

    def test_text_parts_join_without_separator(self):
        out = FlattenToolText().request(
            self.request([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]), CTX
        )
        assert as_dict(out)["messages"][1] == {"role": "tool", "content": "ab", "tool_call_id": "c1"}

    def test_list_with_a_non_text_part_is_untouched(self):
        request = self.request([{"type": "text", "text": "a"}, {"type": "image_url", "image_url": "http://x/y.png"}])
        assert FlattenToolText().request(request, CTX) is request

    def test_string_content_is_untouched(self):
        request = self.request("already a string")
        assert FlattenToolText().request(request, CTX) is request

    def test_other_roles_are_untouched(self):
        request = chat(
            messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
        )
        assert FlattenToolText().request(request, CTX) is request


class TestContextOverflowStatus:
    def test_context_error_becomes_413(self):
        err = ContextLengthError("This model's maximum context length is 8 tokens.", context_length=8, prompt_tokens=9)
        out = ContextOverflowStatus().error(err, CTX)
        assert isinstance(out, PayloadTooLargeError)
        assert out.status == 413 and out.body()["error"]["type"] == "PayloadTooLargeError"
        assert out.message == err.message

    def test_other_errors_pass(self):
        err = EngineBusyError("busy")
        assert ContextOverflowStatus().error(err, CTX) is err


class TestReasoningUsage:
    BODY = {"usage": {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12}}

    def test_adds_reasoning_tokens_to_the_response(self):
        ctx = RuleContext(family="glm", endpoint="chat", context_length=8, reasoning_tokens=4)
        out = ReasoningUsage().response(self.BODY, ctx)
        assert out["usage"]["completion_tokens_details"] == {"reasoning_tokens": 4}
        assert "completion_tokens_details" not in self.BODY["usage"]  # the input is not mutated

    def test_rewrites_only_the_usage_chunk_of_a_stream(self):
        ctx = RuleContext(family="glm", endpoint="chat", context_length=8, include_usage=True, reasoning_tokens=2)

        async def chunks():
            yield {"choices": [{"delta": {}}], "usage": None}
            yield {"choices": [], "usage": {"completion_tokens": 5}}

        async def run():
            return [c async for c in ReasoningUsage().stream(chunks(), ctx)]

        first, last = asyncio.run(run())
        assert first == {"choices": [{"delta": {}}], "usage": None}
        assert last["usage"] == {"completion_tokens": 5, "completion_tokens_details": {"reasoning_tokens": 2}}

    def test_stream_without_usage_is_left_alone(self):
        ctx = RuleContext(family="glm", endpoint="chat", context_length=8, include_usage=False)
        assert ReasoningUsage().stream(None, ctx) is None

    def test_completions_are_left_alone(self):
        ctx = RuleContext(family="glm", endpoint="completions", context_length=8)
        assert ReasoningUsage().response(self.BODY, ctx) is self.BODY
