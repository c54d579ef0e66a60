"""Parsers per format from literal texts: whole text, and the same text split at every chunk boundary."""

import json

import pytest

from deltafin.families import build_output_parser
from deltafin.markup.kimi_k2 import name_from_id
from deltafin.markup.parsing import split_at_marker
from tests.markup.parsing import (
    K3_RESPONSE,
    K3_THINK,
    WEATHER,
    assert_every_split_matches,
    collect,
    make,
    parse_whole,
)

CASES = {
    "kimi_k3_tool_call": (
        "kimi_k3",
        K3_THINK,
        "Need weather.<|close|>think<|sep|><|open|>response<|sep|>Checking.<|close|>response<|sep|>"
        '<|open|>tools<|sep|>\n  <|open|>call tool="get_weather" index="1"<|sep|>'
        '<|open|>argument key="city" type="string"<|sep|> Paris\n<|close|>argument<|sep|>'
        '<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|><|close|>call<|sep|>'
        "<|close|>tools<|sep|><|close|>message<|sep|>",
    ),
    "kimi_k3_thinking_off": ("kimi_k3", K3_RESPONSE, "Hello there.<|close|>response<|sep|><|close|>message<|sep|>"),
    "kimi_k2_tool_call": (
        "kimi_k2",
        "<|im_assistant|>assistant<|im_middle|><think>",
        "Let me look.</think>Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:3"
        '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.now:4'
        "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>",
    ),
    "kimi_k2_odd_section_inside_reasoning": (
        "kimi_k2",
        "<|im_middle|><think>",
        "thinking<|tool_call_section_begin|><|tool_call_begin|>functionsget_weather5<|tool_call_argument_begin|>"
        '{"city": "Oslo"}<|tool_call_end|><|tool_call_section_end|>',
    ),
    "kimi_k2_placeholder_content": (
        "kimi_k2",
        "<|im_middle|><think></think>",
        "(no content)<|tool_calls_section_begin|><|tool_call_begin|>functions.now:0<|tool_call_argument_begin|>{}"
        "<|tool_call_end|><|tool_calls_section_end|>",
    ),
    "glm45_tool_call": (
        "glm45",
        "<|assistant|>",
        "\n<think>hmm</think>\nI will check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
        "<arg_value>  New York \n</arg_value>\n<arg_key> days </arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
    ),
    "glm47_calls_and_text": (
        "glm47",
        "<|assistant|><think>",
        "plan</think>A<tool_call>now</tool_call>B<tool_call> get_weather <arg_key>city</arg_key><arg_value>Rome</arg_value>"
        '<arg_key>opts</arg_key><arg_value>{"a": [1, 2]}</arg_value><arg_key>extra</arg_key><arg_value>7</arg_value>'
        "</tool_call>C",
    ),
    "glm47_tool_call_inside_reasoning": ("glm47", "<|assistant|><think>", "thinking<tool_call>now</tool_call>"),
}


class TestStreamedEqualsWhole:
    @pytest.mark.parametrize("case", sorted(CASES))
    def test_every_chunk_boundary(self, case):
        fmt, prompt, text = CASES[case]
        assert_every_split_matches(fmt, prompt, text)


class TestKimiK3:
    def test_reasoning_answer_and_typed_arguments(self):
        fmt, prompt, text = CASES["kimi_k3_tool_call"]
        result = parse_whole(fmt, prompt, text)
        assert result["reasoning"] == "Need weather." and result["content"] == "Checking."
        assert result["calls"] == [
            {"id": "call_0", "name": "get_weather", "arguments": '{"city": " Paris\\n", "days": 3}'}
        ]

    def test_thinking_off_starts_in_the_answer(self):
        result = parse_whole(*CASES["kimi_k3_thinking_off"])
        assert result["content"] == "Hello there." and result["reasoning"] == ""

    def test_cut_mid_marker_leaks_nothing(self):
        result = parse_whole("kimi_k3", K3_THINK, "thought<|close|>think<|sep|><|open|>", finish="length")
        assert result == {"content": "", "reasoning": "thought", "calls": []}
        result = parse_whole("kimi_k3", K3_THINK, "t<|close|>think<|sep|><|open|>response<|sep|>Hi<|clo", "length")
        assert result["content"] == "Hi"

    def test_escaped_attributes(self):
        text = (
            '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
            '<|open|>argument key="a&quot;b&amp;c" type="string"<|sep|>x<|close|>argument<|sep|><|close|>call<|sep|>'
        )
        call = parse_whole("kimi_k3", K3_RESPONSE, text)["calls"][0]
        assert json.loads(call["arguments"]) == {'a"b&c': "x"}

    def test_what_k3s_encoder_writes_is_read_back(self):
        """As K3's encoder renders a turn with calls (tests/prompt/test_k3_golden.py): an empty response channel
        beside the calls, integers and floats typed `number`, arguments that are not JSON as a `json` span."""
        text = (
            "<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>"
            '<|open|>call tool="get_weather" index="1"<|sep|>'
            '<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|>'
            '<|open|>argument key="ratio" type="number"<|sep|>2.5<|close|>argument<|sep|><|close|>call<|sep|>'
            '<|open|>call tool="get_weather" index="2"<|sep|><|open|>json type="object"<|sep|>{city: Paris}'
            "<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
        )
        result = assert_every_split_matches("kimi_k3", K3_THINK, "plan" + text)
        assert result["reasoning"] == "plan" and result["content"] == ""
        assert [c["arguments"] for c in result["calls"]] == ['{"days": 3, "ratio": 2.5}', "{city: Paris}"]


class TestKimiK2:
    def test_ids_verbatim_and_names(self):
        result = parse_whole(*CASES["kimi_k2_tool_call"])
        assert result["reasoning"] == "Let me look." and result["content"] == "Sure."
        assert [(c["id"], c["name"], c["arguments"]) for c in result["calls"]] == [
            ("functions.get_weather:3", "get_weather", '{"city": "Paris"}'),
            ("functions.now:4", "now", "{}"),
        ]

    def test_singular_section_inside_reasoning_and_odd_id(self):
        result = parse_whole(*CASES["kimi_k2_odd_section_inside_reasoning"])
        assert result["reasoning"] == "thinking"
        assert result["calls"] == [
            {"id": "functionsget_weather5", "name": "get_weather", "arguments": '{"city": "Oslo"}'}
        ]

    @pytest.mark.parametrize(
        "call_id,name",
        [
            ("functions.get_weather:0", "get_weather"),
            ("functionsnow5", "now"),
            ("get_weather:2", "get_weather"),
            ("functions.get_weather_2", "get_weather_2"),
            ("functions.get_news:1", "get_news"),
            ("functions.invalid_get_weather.0", "invalid_get_weather"),
            ("call00003", None),
            ("0", None),
        ],
    )
    def test_name_from_id(self, call_id, name):
        assert name_from_id(call_id, {"get_weather": {}, "now": {}, "get_weather_2": {}}) == name

    def test_placeholder_content_before_a_call_is_dropped(self):
        result = parse_whole(*CASES["kimi_k2_placeholder_content"])
        assert result["content"] == "" and result["calls"][0]["name"] == "now"

    @pytest.mark.parametrize("text", ["(no content)", "(no content) but more", "(no"])
    def test_placeholder_like_text_without_a_call_stays(self, text):
        assert parse_whole("kimi_k2", "<|im_middle|><think></think>", text)["content"] == text

    def test_thinking_off_prompt_starts_in_content(self):
        result = parse_whole("kimi_k2", "<|im_middle|><think></think>", "Plain answer.")
        assert result["content"] == "Plain answer." and result["reasoning"] == ""


class TestGlm:
    def test_glm45_values_keep_whitespace_keys_and_names_stripped(self):
        result = parse_whole(*CASES["glm45_tool_call"])
        assert result["reasoning"] == "hmm" and result["content"] == "\nI will check.\n"
        assert json.loads(result["calls"][0]["arguments"]) == {"city": "  New York \n", "days": 3}
        assert result["calls"][0]["name"] == "get_weather"

    def test_glm47_zero_argument_calls_and_text_between(self):
        result = parse_whole(*CASES["glm47_calls_and_text"])
        assert result["reasoning"] == "plan" and result["content"] == "ABC"
        assert [c["name"] for c in result["calls"]] == ["now", "get_weather"]
        assert result["calls"][0]["arguments"] == "{}"
        assert json.loads(result["calls"][1]["arguments"]) == {"city": "Rome", "opts": {"a": [1, 2]}, "extra": 7}

    def test_tool_call_inside_reasoning_ends_it(self):
        result = parse_whole(*CASES["glm47_tool_call_inside_reasoning"])
        assert result["reasoning"] == "thinking" and result["calls"][0]["name"] == "now"

    def test_glm47_cut_by_length_stays_reasoning(self):
        result = parse_whole("glm47", "<|assistant|><think>", "still thinking", finish="length")
        assert result["reasoning"] == "still thinking" and result["content"] == ""

    def test_glm45_model_opens_think_itself(self):
        assert parse_whole("glm45", "<|assistant|>", "<think>a</think>b")["reasoning"] == "a"

    def test_glm45_thinking_off(self):
        result = parse_whole("glm45", "<|assistant|>\n<think></think>", "answer")
        assert result == {"content": "answer", "reasoning": "", "calls": []}

    def test_undeclared_string_value_stays_text(self):
        text = "<tool_call>get_weather<arg_key>note</arg_key><arg_value>hello world</arg_value></tool_call>"
        assert json.loads(parse_whole("glm47", "<|assistant|></think>", text)["calls"][0]["arguments"]) == {
            "note": "hello world"
        }

    def test_cut_mid_tag_leaks_nothing(self):
        assert parse_whole("glm47", "<|assistant|></think>", "Hi<tool_ca", finish="length")["content"] == "Hi"


class TestIds:
    def test_kimi_ids_count_over_the_conversation(self):
        text = (
            '<|open|>tools<|sep|><|open|>call tool="now" index="1"<|sep|><|close|>call<|sep|>'
            '<|open|>call tool="get_weather" index="2"<|sep|><|close|>call<|sep|><|close|>tools<|sep|>'
        )
        parser = build_output_parser("kimi_k3", prompt_text=K3_RESPONSE, tool_schemas=WEATHER, history_calls=2)
        assert [c["id"] for c in collect(parser, [text])["calls"]] == ["functions.now:2", "functions.get_weather:3"]

    def test_glm_ids_are_random_and_distinct(self):
        parser = build_output_parser("glm", "glm47", prompt_text="</think>", tool_schemas=WEATHER)
        calls = collect(parser, ["<tool_call>now</tool_call><tool_call>now</tool_call>"])["calls"]
        assert calls[0]["id"].startswith("call_") and calls[0]["id"] != calls[1]["id"]


class TestWithoutTools:
    def test_tool_markup_is_content_when_no_tools_are_declared(self):
        parser = build_output_parser("glm", "glm47", prompt_text="<|assistant|></think>", tool_schemas=None)
        text = "<tool_call>now</tool_call>"
        assert collect(parser, [text])["content"] == text


class TestSplitAtMarker:
    def test_holds_a_partial_marker(self):
        assert split_at_marker("abc<too", ["<tool_call>"]) == ("abc", None, "<too")

    def test_finds_the_earliest(self):
        assert split_at_marker("a</x>b<y>", ["<y>", "</x>"]) == ("a", "</x>", "b<y>")


class TestFuzz:
    """Random soups of markers and text: never an exception, and streamed always equals whole."""

    PIECES = {
        "kimi_k3": [
            "<|open|>",
            "<|close|>",
            "<|sep|>",
            "think",
            "response",
            "tools",
            'call tool="now" index="1"',
            'argument key="k" type="string"',
            'argument key="n" type="integer"',
            "argument",
            "call",
            "message",
            "x",
            " ",
            "\n",
            "12",
            '"',
            "&quot;",
        ],
        "kimi_k2": [
            "<think>",
            "</think>",
            "<|tool_calls_section_begin|>",
            "<|tool_call_section_end|>",
            "<|tool_call_begin|>",
            "<|tool_call_argument_begin|>",
            "<|tool_call_end|>",
            "functions.now:1",
            "(no content)",
            "{",
            "}",
            "x",
            " ",
            "\n",
        ],
        "glm47": [
            "<think>",
            "</think>",
            "<tool_call>",
            "</tool_call>",
            "<arg_key>",
            "</arg_key>",
            "<arg_value>",
            "</arg_value>",
            "get_weather",
            "city",
            "days",
            "3",
            "x",
            " ",
            "\n",
            '{"a": 1}',
        ],
        "qwen3": [
            "<think>",
            "</think>",
            "<tool_call>",
            "</tool_call>",
            '{"name": "now", "arguments": ',
            "{",
            "}",
            '"city": ',
            '"x"',
            "x",
            " ",
            "\n",
            "<",
        ],
    }
    PROMPTS = {
        "kimi_k3": K3_THINK,
        "kimi_k2": "<|im_middle|><think>",
        "glm47": "<|assistant|><think>",
        "qwen3": "<|im_start|>assistant\n",
    }

    @pytest.mark.parametrize("fmt", sorted(PIECES))
    def test_random_soups(self, fmt):
        import random

        rng = random.Random(1234)
        for _ in range(150):
            text = "".join(rng.choice(self.PIECES[fmt]) for _ in range(rng.randint(1, 30)))
            finish = rng.choice(["stop", "length"])
            whole = parse_whole(fmt, self.PROMPTS[fmt], text, finish)
            cuts = sorted(rng.sample(range(1, len(text)), min(4, len(text) - 1))) if len(text) > 1 else []
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
            assert collect(make(fmt, self.PROMPTS[fmt]), pieces, finish) == whole, text
