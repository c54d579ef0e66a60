"""The parsers' required behaviours, one class each; every case is checked whole and at every chunk boundary."""

import pytest

from tests.markup.parsing import (
    K3_RESPONSE,
    K3_THINK,
    WEATHER,
    assert_every_split_matches,
    calls_of,
    tool,
)

K2_THINK = "<|im_assistant|>assistant<|im_middle|><think>"
K2_ANSWER = "<|im_assistant|>assistant<|im_middle|><think></think>"
GLM47_THINK = "<|assistant|><think>"
GLM47_ANSWER = "<|assistant|></think>"
QWEN3 = "<|im_start|>assistant\n"
SECTION = "<|tool_calls_section_begin|>{}<|tool_calls_section_end|>"


def k2_call(call_id, arguments):
    return f"<|tool_call_begin|>{call_id} <|tool_call_argument_begin|>{arguments}<|tool_call_end|>"


class TestRepeatedOpenerIsDropped:
    """1. The prompt already opened reasoning and the model writes the opener again."""

    @pytest.mark.parametrize(
        "fmt,prompt", [("glm47", GLM47_THINK), ("kimi_k2", K2_THINK), ("qwen3", QWEN3 + "<think>")]
    )
    def test_think(self, fmt, prompt):
        result = assert_every_split_matches(fmt, prompt, "<think>plan</think>answer")
        assert (result["reasoning"], result["content"]) == ("plan", "answer")

    def test_think_after_whitespace(self):
        result = assert_every_split_matches("glm47", GLM47_THINK, "\n<think>plan</think>answer")
        assert (result["reasoning"], result["content"]) == ("plan", "answer")

    def test_k3(self):
        text = "<|open|>think<|sep|>step<|close|>think<|sep|><|open|>response<|sep|>answer<|close|>response<|sep|>"
        result = assert_every_split_matches("kimi_k3", K3_THINK, text)
        assert (result["reasoning"], result["content"]) == ("step", "answer")

    def test_a_later_opener_in_reasoning_text_is_text(self):
        result = assert_every_split_matches("glm47", GLM47_THINK, "a <think> b</think>c")
        assert (result["reasoning"], result["content"]) == ("a <think> b", "c")


class TestReasoningOpenAtTheEndStaysReasoning:
    """2. Reasoning not closed when generation ends is reasoning_content, never repeated as content."""

    @pytest.mark.parametrize("finish", ["stop", "length"])
    @pytest.mark.parametrize(
        "fmt,prompt",
        [("glm47", GLM47_THINK), ("kimi_k2", K2_THINK), ("kimi_k3", K3_THINK), ("qwen3", QWEN3 + "<think>")],
    )
    def test_prefilled(self, fmt, prompt, finish):
        result = assert_every_split_matches(fmt, prompt, "The answer is 4.", finish)
        assert result == {"content": "", "reasoning": "The answer is 4.", "calls": []}

    @pytest.mark.parametrize("fmt", ["glm45", "qwen3"])
    def test_opened_by_the_model(self, fmt):
        result = assert_every_split_matches(fmt, "", "<think>still thinking")
        assert result == {"content": "", "reasoning": "still thinking", "calls": []}


class TestKimiK2NamelessIds:
    """3. A call id without a function name (`0`, `call00003`): the name comes from the declared tools when
    that is unambiguous, else the call is dropped; a name is never invented."""

    READ_FILE = tool("read_file", path={"type": "string"})
    WEATHER = tool("get_weather", city={"type": "string"}, unit={"type": "string"})
    FLIGHT = tool("book_flight", city={"type": "string"})

    @pytest.mark.parametrize("call_id", ["0", "5", "call00003"])
    def test_the_only_declared_tool(self, call_id):
        text = "Let me check. " + SECTION.format(k2_call(call_id, '{"city": "Tokyo", "unit": "celsius"}'))
        result = assert_every_split_matches("kimi_k2", K2_ANSWER, text, tools=[self.WEATHER])
        assert result["content"] == "Let me check. "
        assert [(c["id"], c["name"]) for c in result["calls"]] == [(call_id, "get_weather")]
        assert calls_of(result) == [("get_weather", {"city": "Tokyo", "unit": "celsius"})]

    def test_the_only_declared_tool_keeps_invalid_json(self):
        text = SECTION.format(k2_call("0", '{"city": "Tokyo"'))
        result = assert_every_split_matches("kimi_k2", K2_ANSWER, text, tools=[self.WEATHER])
        assert calls_of(result) == [("get_weather", '{"city": "Tokyo"')]

    def test_inferred_from_the_arguments(self):
        text = SECTION.format(k2_call("0", '{"city": "Tokyo", "unit": "celsius"}'))
        result = assert_every_split_matches("kimi_k2", K2_ANSWER, text, tools=[self.READ_FILE, self.WEATHER])
        assert calls_of(result) == [("get_weather", {"city": "Tokyo", "unit": "celsius"})]

    @pytest.mark.parametrize("arguments", ['{"city": "Tokyo"}', '{"city": "Tokyo"'])
    def test_ambiguous_or_unreadable_is_dropped(self, arguments):
        text = "Let me check. " + SECTION.format(k2_call("0", arguments))
        result = assert_every_split_matches("kimi_k2", K2_ANSWER, text, tools=[self.WEATHER, self.FLIGHT])
        assert result == {"content": "Let me check. ", "reasoning": "", "calls": []}

    def test_numbering_skips_a_dropped_call(self):
        text = SECTION.format(
            k2_call("0", '{"city": "Tokyo"}') + k2_call("functions.book_flight:1", '{"city": "Oslo"}')
        )
        result = assert_every_split_matches("kimi_k2", K2_ANSWER, text, tools=[self.WEATHER, self.FLIGHT])
        assert [(c["id"], c["name"]) for c in result["calls"]] == [("functions.book_flight:1", "book_flight")]


class TestKimiK2IdsMatchExactly:
    """4. A malformed id names its own function; a declared name inside it is not a match."""

    def test_no_substring_match(self):
        text = SECTION.format(
            k2_call("functions.invalid_get_weather.0", '{"city": "Beijing"}')
            + k2_call("functions.valid_get_weather:1", '{"city": "Shanghai"}')
        )
        tools = [tool("valid_get_weather", city={"type": "string"})]
        result = assert_every_split_matches("kimi_k2", K2_ANSWER, text, tools=tools)
        assert [c["name"] for c in result["calls"]] == ["invalid_get_weather", "valid_get_weather"]


class TestKimiK2StrayMarkersAreNotContent:
    """5. Section and argument markers outside a tool section are control tokens."""

    def test_stray_markers(self):
        text = "Hello<|tool_calls_section_end|> world<|tool_call_argument_begin|>!<|tool_call_end|>"
        result = assert_every_split_matches("kimi_k2", K2_ANSWER, text)
        assert result == {"content": "Hello world!", "reasoning": "", "calls": []}

    def test_after_a_section(self):
        text = SECTION.format(k2_call("functions.now:0", "{}")) + "<|tool_call_section_end|>Done."
        result = assert_every_split_matches("kimi_k2", K2_ANSWER, text)
        assert result["content"] == "Done." and [c["name"] for c in result["calls"]] == ["now"]


class TestHeldTextIsReleasedAtANormalEnd:
    """6. A trailing "<" that might have begun a marker is text when generation ends normally; after
    max_tokens a cut marker is still dropped."""

    @pytest.mark.parametrize(
        "fmt,prompt",
        [
            ("kimi_k2", K2_ANSWER),
            ("kimi_k3", K3_RESPONSE),
            ("glm47", GLM47_ANSWER),
            ("glm45", "<|assistant|>\n<think></think>"),
            ("qwen3", QWEN3),
        ],
    )
    def test_content(self, fmt, prompt):
        result = assert_every_split_matches(fmt, prompt, "normal text <")
        assert result == {"content": "normal text <", "reasoning": "", "calls": []}

    @pytest.mark.parametrize("fmt,prompt", [("kimi_k2", K2_THINK), ("glm47", GLM47_THINK), ("kimi_k3", K3_THINK)])
    def test_reasoning(self, fmt, prompt):
        assert assert_every_split_matches(fmt, prompt, "is 3 < 4? yes <")["reasoning"] == "is 3 < 4? yes <"

    @pytest.mark.parametrize(
        "fmt,prompt,text",
        [
            ("kimi_k2", K2_ANSWER, "Hi<|tool_calls_sec"),
            ("glm47", GLM47_ANSWER, "Hi<tool_ca"),
            ("kimi_k3", K3_RESPONSE, "Hi<|clo"),
            ("qwen3", QWEN3, "Hi<tool_"),
        ],
    )
    def test_cut_marker_after_max_tokens_is_dropped(self, fmt, prompt, text):
        assert assert_every_split_matches(fmt, prompt, text, "length")["content"] == "Hi"

    def test_think_parser_start(self):
        result = assert_every_split_matches("glm45", "<|assistant|>", "<thi")
        assert result["content"] == "<thi"


class TestNoCallWithoutAName:
    """7. A call whose name is empty or whitespace is dropped; the text around it stays."""

    @pytest.mark.parametrize(
        "fmt,text",
        [
            ("glm47", "A<tool_call> <arg_key>city</arg_key><arg_value>Rome</arg_value></tool_call>B"),
            ("glm47", "A<tool_call></tool_call>B"),
            ("glm45", "A<tool_call>\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n</tool_call>B"),
        ],
    )
    def test_glm(self, fmt, text):
        result = assert_every_split_matches(fmt, GLM47_ANSWER, text)
        assert result == {"content": "AB", "reasoning": "", "calls": []}

    def test_glm_next_call_is_numbered_from_zero(self):
        result = assert_every_split_matches("glm47", GLM47_ANSWER, "<tool_call> </tool_call><tool_call>now</tool_call>")
        assert [(c["id"], c["name"]) for c in result["calls"]] == [("call_0", "now")]

    def test_k3(self):
        text = (
            '<|open|>tools<|sep|><|open|>call tool=" " index="1"<|sep|><|open|>argument key="a" type="string"<|sep|>'
            "x<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>"
        )
        assert assert_every_split_matches("kimi_k3", K3_RESPONSE, text)["calls"] == []

    def test_hermes(self):
        text = 'A<tool_call>\n{"name": " ", "arguments": {"a": 1}}\n</tool_call>B'
        assert assert_every_split_matches("qwen3", QWEN3, text) == {"content": "AB", "reasoning": "", "calls": []}


class TestSchemaTypesReadUnions:
    """8. A field whose schema allows a string (`anyOf`, `oneOf`, a type list) keeps the raw text."""

    TOOLS = [
        tool(
            "note",
            text={"anyOf": [{"type": "string"}, {"type": "null"}]},
            label={"oneOf": [{"type": "null"}, {"type": "string"}]},
            tag={"type": ["null", "string"]},
            count={"anyOf": [{"type": "integer"}, {"type": "null"}]},
        )
    ]

    def test_optional_strings_stay_strings(self):
        text = (
            "<tool_call>note<arg_key>text</arg_key><arg_value>true</arg_value><arg_key>label</arg_key>"
            "<arg_value>12</arg_value><arg_key>tag</arg_key><arg_value>null</arg_value>"
            "<arg_key>count</arg_key><arg_value>3</arg_value></tool_call>"
        )
        result = assert_every_split_matches("glm47", GLM47_ANSWER, text, tools=self.TOOLS)
        assert calls_of(result) == [("note", {"text": "true", "label": "12", "tag": "null", "count": 3})]


class TestBlankContentBesideCallsIsNull:
    """9. Whitespace-only content beside tool calls is no content; without calls it is kept."""

    @pytest.mark.parametrize(
        "fmt,prompt,text",
        [
            ("glm47", GLM47_ANSWER, "  \n  <tool_call>now</tool_call>\n"),
            ("glm47", GLM47_ANSWER, "\n<tool_call>now</tool_call>\n<tool_call>now</tool_call>\n"),
            ("kimi_k2", K2_ANSWER, "\n    " + SECTION.format(k2_call("functions.now:0", "{}")) + "\n"),
            (
                "kimi_k3",
                K3_RESPONSE,
                '\n  <|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="now" index="1"<|sep|>'
                "<|close|>call<|sep|><|close|>tools<|sep|>",
            ),
            ("qwen3", QWEN3, '\n\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'),
        ],
    )
    def test_dropped_beside_calls(self, fmt, prompt, text):
        result = assert_every_split_matches(fmt, prompt, text)
        assert result["content"] == "" and {c["name"] for c in result["calls"]} == {"now"}

    def test_kept_without_calls(self):
        assert assert_every_split_matches("glm47", GLM47_ANSWER, "\n  \n")["content"] == "\n  \n"

    def test_real_text_keeps_its_whitespace(self):
        result = assert_every_split_matches("glm47", GLM47_ANSWER, "\nSure.\n<tool_call>now</tool_call>\n")
        assert result["content"] == "\nSure.\n\n"


class TestKimiK3CallsOnlyWhenAllowed:
    """10. Without tools declared or with tool_choice "none" (calls_allowed false) K3 reports no call, and the
    tools channel is not content either (its markers are control tokens)."""

    TEXT = (
        'Sure.<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="now" index="1"<|sep|>'
        '<|open|>argument key="a" type="string"<|sep|>x<|close|>argument<|sep|><|close|>call<|sep|>'
        "<|close|>tools<|sep|><|close|>message<|sep|>"
    )

    @pytest.mark.parametrize("options", [{"tools": None}, {"tools": WEATHER, "calls_allowed": False}])
    def test_no_calls(self, options):
        result = assert_every_split_matches("kimi_k3", K3_RESPONSE, self.TEXT, **options)
        assert result == {"content": "Sure.", "reasoning": "", "calls": []}


class TestKimiK3MessageEnd:
    """11. `<|end_of_msg|>` and anything after `<|close|>message<|sep|>` are not content."""

    @pytest.mark.parametrize(
        "text",
        [
            "Hello<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>",
            "Hello<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>trailing text",
            "Hello<|close|>message<|sep|>",
            "Hello<|end_of_msg|>",
        ],
    )
    def test_response(self, text):
        assert assert_every_split_matches("kimi_k3", K3_RESPONSE, text)["content"] == "Hello"

    def test_after_a_closed_message_nothing_is_parsed(self):
        text = (
            "Done.<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|><|open|>tools<|sep|>"
            '<|open|>call tool="now" index="1"<|sep|><|close|>call<|sep|><|close|>tools<|sep|>'
        )
        result = assert_every_split_matches("kimi_k3", K3_RESPONSE, text)
        assert result == {"content": "Done.", "reasoning": "", "calls": []}


class TestWherePeersDisagreeTheModelsOutputIsKept:
    """Undeclared calls are returned, text between calls is kept, a call cut by max_tokens keeps its
    partial arguments."""

    @pytest.mark.parametrize(
        "fmt,prompt,text",
        [
            ("kimi_k2", K2_ANSWER, SECTION.format(k2_call("functions.get_news:0", '{"topic": "tech"}'))),
            (
                "glm47",
                GLM47_ANSWER,
                "<tool_call>get_news<arg_key>topic</arg_key><arg_value>tech</arg_value></tool_call>",
            ),
            ("qwen3", QWEN3, '<tool_call>\n{"name": "get_news", "arguments": {"topic": "tech"}}\n</tool_call>'),
            (
                "kimi_k3",
                K3_RESPONSE,
                '<|open|>tools<|sep|><|open|>call tool="get_news" index="1"<|sep|><|open|>argument '
                'key="topic" type="string"<|sep|>tech<|close|>argument<|sep|><|close|>call<|sep|>',
            ),
        ],
    )
    def test_undeclared_calls_are_returned(self, fmt, prompt, text):
        assert calls_of(assert_every_split_matches(fmt, prompt, text)) == [("get_news", {"topic": "tech"})]

    @pytest.mark.parametrize(
        "fmt,prompt,text",
        [
            ("kimi_k2", K2_ANSWER, "Before. " + SECTION.format(k2_call("functions.now:0", "{}")) + " After tools."),
            ("glm47", GLM47_ANSWER, "Before. <tool_call>now</tool_call> After tools."),
            ("qwen3", QWEN3, 'Before. <tool_call>\n{"name": "now", "arguments": {}}\n</tool_call> After tools.'),
        ],
    )
    def test_text_around_calls_is_kept(self, fmt, prompt, text):
        result = assert_every_split_matches(fmt, prompt, text)
        assert result["content"] == "Before.  After tools." and [c["name"] for c in result["calls"]] == ["now"]

    @pytest.mark.parametrize(
        "fmt,prompt,text,arguments",
        [
            (
                "kimi_k2",
                K2_ANSWER,
                SECTION[: -len("{}<|tool_calls_section_end|>")] + "<|tool_call_begin|>functions.get_weather:0 "
                '<|tool_call_argument_begin|>{"city": "Bei',
                '{"city": "Bei',
            ),
            ("glm47", GLM47_ANSWER, "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Bei", '{"city": "Bei'),
            ("glm47", GLM47_ANSWER, "<tool_call>get_weather<arg_key>opts</arg_key><arg_value>[1, ", '{"opts": [1, '),
            ("qwen3", QWEN3, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bei', '{"city": "Bei'),
            (
                "kimi_k3",
                K3_RESPONSE,
                '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
                '<|open|>argument key="city" type="string"<|sep|>Bei',
                '{"city": "Bei',
            ),
            (
                "kimi_k3",
                K3_RESPONSE,
                '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
                '<|open|>argument key="opts" type="object"<|sep|>{"a": ',
                '{"opts": {"a": ',
            ),
        ],
    )
    def test_a_cut_call_keeps_its_partial_arguments(self, fmt, prompt, text, arguments):
        result = assert_every_split_matches(fmt, prompt, text, "length")
        assert [(c["name"], c["arguments"]) for c in result["calls"]] == [("get_weather", arguments)]
