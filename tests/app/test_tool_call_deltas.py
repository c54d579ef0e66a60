"""The OpenAI shape of streamed tool-call deltas, from parser output."""

from deltafin.markup import ParsedDelta, ToolCallDelta
from deltafin.serving.chat import tool_call_deltas


class TestToolCallDeltas:
    def test_head_keeps_empty_arguments_even_when_fragments_arrive_with_it(self):
        parsed = ParsedDelta(
            tool_calls=[
                ToolCallDelta(0, "call_1", "get_weather", ""),
                ToolCallDelta(0, arguments='{"city": '),
                ToolCallDelta(0, arguments='"Paris"}'),
            ]
        )
        assert tool_call_deltas(parsed) == [
            {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}},
            {"index": 0, "function": {"arguments": '{"city": "Paris"}'}},
        ]

    def test_calls_keep_their_own_index(self):
        parsed = ParsedDelta(
            tool_calls=[
                ToolCallDelta(0, arguments="}"),
                ToolCallDelta(1, "call_2", "now", ""),
                ToolCallDelta(1, arguments="{}"),
            ]
        )
        assert [d["index"] for d in tool_call_deltas(parsed)] == [0, 1, 1]
