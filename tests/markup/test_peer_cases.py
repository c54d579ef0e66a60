"""Cases from vLLM's tests/tool_parsers and tests/reasoning and SGLang's test/registered/function_call for
these formats (their inputs and expected outputs, restated as facts), replayed whole and at every chunk
boundary. Where the peers disagree with each other, or with Deltafin's rule of keeping the model's output,
the case says so and asserts Deltafin's choice (docs/families.md)."""

import pytest

from tests.markup.parsing import K3_MESSAGE, K3_THINK, assert_every_split_matches, calls_of, tool

SB, SE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
TB, TE, AB = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"
K2 = "<|im_assistant|>assistant<|im_middle|><think></think>"
K2_TOOLS = [tool("get_weather", city={"type": "string"}, unit={"type": "string"})]
PYTHON = [tool("python", code={"type": "string"})]
GLM_TOOLS = [tool("get_current_date"), tool("get_weather", city={"type": "string"}, date={"type": "string"})]
TOOLS_OPEN, TOOLS_CLOSE = "<|open|>tools<|sep|>", "<|close|>tools<|sep|>"
RESPONSE = "<|open|>response<|sep|>", "<|close|>response<|sep|>"


def k2(call_id, arguments):
    return f"{TB}{call_id} {AB}{arguments}{TE}"


def k3_call(name, index, *args):
    spans = "".join(f'<|open|>argument key="{k}" type="{t}"<|sep|>{v}<|close|>argument<|sep|>' for k, t, v in args)
    return f'<|open|>call tool="{name}" index="{index}"<|sep|>{spans}<|close|>call<|sep|>'


#: id -> (dialect, prompt, text, finish, tools, content, reasoning, [(name, arguments)])
CASES = {
    # vLLM tests/tool_parsers/test_kimi_k2_tool_parser.py
    "vllm_k2_single": (
        "kimi_k2",
        K2,
        "I'll check. " + SB + k2("functions.get_weather:0", '{"city": "Beijing"}') + SE,
        "stop",
        K2_TOOLS,
        "I'll check. ",
        "",
        [("get_weather", {"city": "Beijing"})],
    ),
    "vllm_k2_three_calls": (
        "kimi_k2",
        K2,
        "Multiple tasks. "
        + SB
        + k2("functions.get_weather:0", '{"city": "New York"}')
        + k2("functions.get_news:1", '{"topic": "technology"}')
        + k2("functions.send_email:2", '{"to": "user@example.com", "subject": "Daily Update"}')
        + SE,
        "stop",
        K2_TOOLS,
        "Multiple tasks. ",
        "",
        [
            ("get_weather", {"city": "New York"}),
            ("get_news", {"topic": "technology"}),
            ("send_email", {"to": "user@example.com", "subject": "Daily Update"}),
        ],
    ),
    "vllm_k2_angle_brackets_in_json": (
        "kimi_k2",
        K2,
        "Process HTML. " + SB + k2("functions.process_html:0", '{"html": "<div>content</div>"}') + SE,
        "stop",
        K2_TOOLS,
        "Process HTML. ",
        "",
        [("process_html", {"html": "<div>content</div>"})],
    ),
    "vllm_k2_multiline_json": (
        "kimi_k2",
        K2,
        "Formatted. " + SB + k2("functions.process_data:0", '{\n  "name": "test",\n  "value": 123\n}') + SE,
        "stop",
        K2_TOOLS,
        "Formatted. ",
        "",
        [("process_data", {"name": "test", "value": 123})],
    ),
    "vllm_k2_no_functions_prefix": (
        "kimi_k2",
        K2,
        "No prefix. " + SB + k2("get_weather:0", '{"city": "Tokyo"}') + SE,
        "stop",
        K2_TOOLS,
        "No prefix. ",
        "",
        [("get_weather", {"city": "Tokyo"})],
    ),
    "vllm_k2_empty_arguments": (
        "kimi_k2",
        K2,
        "Empty args. " + SB + k2("functions.test:0", "{}") + SE,
        "stop",
        K2_TOOLS,
        "Empty args. ",
        "",
        [("test", {})],
    ),
    "vllm_k2_invalid_json_still_extracted": (
        "kimi_k2",
        K2,
        "Help. "
        + SB
        + k2("functions.bad:0", '{"city": "Beijing"')
        + k2("functions.good:1", '{"city": "Shanghai"}')
        + SE,
        "stop",
        K2_TOOLS,
        "Help. ",
        "",
        [("bad", '{"city": "Beijing"'), ("good", {"city": "Shanghai"})],
    ),
    # vLLM skips `functions.invalid.0` (no colon + digit); Deltafin keeps the model's call under its own name.
    "vllm_k2_malformed_id_kept": (
        "kimi_k2",
        K2,
        "Help. "
        + SB
        + k2("functions.invalid.0", '{"city": "Beijing"}')
        + k2("functions.valid:1", '{"city": "Shanghai"}')
        + SE,
        "stop",
        K2_TOOLS,
        "Help. ",
        "",
        [("invalid", {"city": "Beijing"}), ("valid", {"city": "Shanghai"})],
    ),
    "vllm_k2_noise_between_markers": (
        "kimi_k2",
        K2,
        "Reasoning. " + SB + " spurious noise " + k2("functions.test:0", '{"k": "v"} ') + SE,
        "stop",
        K2_TOOLS,
        "Reasoning. ",
        "",
        [("test", {"k": "v"})],
    ),
    "vllm_k2_empty_section": ("kimi_k2", K2, "Reasoning. " + SB + SE, "stop", K2_TOOLS, "Reasoning. ", "", []),
    "vllm_k2_truncated_call": (
        "kimi_k2",
        K2,
        "I'll check. " + SB + TB + "functions.get_weather:0 " + AB + '{"city": "Bei',
        "length",
        K2_TOOLS,
        "I'll check. ",
        "",
        [("get_weather", '{"city": "Bei')],
    ),
    # vLLM drops text after the section; SGLang and Deltafin keep it.
    "vllm_k2_content_after_section": (
        "kimi_k2",
        K2,
        "Before. " + SB + k2("functions.get_weather:0", '{"city": "Tokyo"} ') + SE + " After tools.",
        "stop",
        K2_TOOLS,
        "Before.  After tools.",
        "",
        [("get_weather", {"city": "Tokyo"})],
    ),
    # vLLM tests/reasoning/test_kimi_k3_reasoning_parser.py and tests/tool_parsers/test_kimi_k3_tool_parser.py
    "vllm_k3_repeated_think_opener": (
        "kimi_k3",
        K3_THINK,
        "<|open|>think<|sep|>step<|close|>think<|sep|>" + RESPONSE[0] + "answer",
        "stop",
        PYTHON,
        "answer",
        "step",
        [],
    ),
    "vllm_k3_generation_prefix_consumed": (
        "kimi_k3",
        K3_THINK,
        "step<|close|>think<|sep|>" + RESPONSE[0] + "answer",
        "stop",
        PYTHON,
        "answer",
        "step",
        [],
    ),
    "vllm_k3_truncated_reasoning": (
        "kimi_k3",
        K3_THINK,
        "unfinished reasoning",
        "length",
        PYTHON,
        "",
        "unfinished reasoning",
        [],
    ),
    "vllm_k3_message_close": (
        "kimi_k3",
        K3_MESSAGE,
        RESPONSE[0] + "Hello<|close|>message<|sep|>",
        "stop",
        PYTHON,
        "Hello",
        "",
        [],
    ),
    # SGLang test/registered/function_call/test_kimik3_detector.py
    "sglang_k3_single_call": (
        "kimi_k3",
        K3_MESSAGE,
        RESPONSE[0]
        + "Let me run it."
        + RESPONSE[1]
        + TOOLS_OPEN
        + k3_call("python", 1, ("code", "string", "print(1)"), ("opts", "object", '{"a": 1}'))
        + TOOLS_CLOSE,
        "stop",
        PYTHON,
        "Let me run it.",
        "",
        [("python", {"code": "print(1)", "opts": {"a": 1}})],
    ),
    "sglang_k3_no_tools_channel": (
        "kimi_k3",
        K3_MESSAGE,
        RESPONSE[0] + "hi there" + RESPONSE[1] + "<|close|>message<|sep|>",
        "stop",
        PYTHON,
        "hi there",
        "",
        [],
    ),
    "sglang_k3_two_calls": (
        "kimi_k3",
        K3_MESSAGE,
        TOOLS_OPEN
        + k3_call("python", 1, ("code", "string", "a"))
        + k3_call("python", 2, ("code", "string", "b"))
        + TOOLS_CLOSE,
        "stop",
        PYTHON,
        "",
        "",
        [("python", {"code": "a"}), ("python", {"code": "b"})],
    ),
    "sglang_k3_unclosed_tools_section": (
        "kimi_k3",
        K3_MESSAGE,
        TOOLS_OPEN + k3_call("python", 1, ("code", "string", "x")),
        "stop",
        PYTHON,
        "",
        "",
        [("python", {"code": "x"})],
    ),
    "sglang_k3_attribute_unescaping_raw_string": (
        "kimi_k3",
        K3_MESSAGE,
        TOOLS_OPEN + k3_call("a&amp;b", 1, ("q", "string", "say &quot;hi&quot;")) + TOOLS_CLOSE,
        "stop",
        PYTHON,
        "",
        "",
        [("a&b", {"q": "say &quot;hi&quot;"})],
    ),
    "sglang_k3_non_string_decoding": (
        "kimi_k3",
        K3_MESSAGE,
        TOOLS_OPEN
        + k3_call("python", 1, ("n", "number", "42"), ("flag", "boolean", "true"), ("bad", "object", "{not json"))
        + TOOLS_CLOSE,
        "stop",
        PYTHON,
        "",
        "",
        [("python", {"n": 42, "flag": True, "bad": "{not json"})],
    ),
    "sglang_k3_plain_text": ("kimi_k3", K3_MESSAGE, "just a plain reply", "stop", PYTHON, "just a plain reply", "", []),
    "sglang_k3_end_releases_held_text": ("kimi_k3", K3_MESSAGE, "all done<", "stop", PYTHON, "all done<", "", []),
    "sglang_k3_end_drops_truncated_marker": (
        "kimi_k3",
        K3_MESSAGE,
        "all done<|open|>",
        "stop",
        PYTHON,
        "all done",
        "",
        [],
    ),
    # vLLM tests/tool_parsers/test_glm47_moe_tool_parser.py
    "vllm_glm47_zero_arg_inline": (
        "glm47",
        "<|assistant|></think>",
        "<tool_call>get_current_date</tool_call>",
        "stop",
        GLM_TOOLS,
        "",
        "",
        [("get_current_date", {})],
    ),
    "vllm_glm47_zero_arg_newline": (
        "glm47",
        "<|assistant|></think>",
        "<tool_call>get_current_date\n</tool_call>",
        "stop",
        GLM_TOOLS,
        "",
        "",
        [("get_current_date", {})],
    ),
    "vllm_glm47_args_with_newlines": (
        "glm47",
        "<|assistant|></think>",
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n</tool_call>",
        "stop",
        GLM_TOOLS,
        "",
        "",
        [("get_weather", {"city": "Beijing"})],
    ),
    "vllm_glm47_content_before": (
        "glm47",
        "<|assistant|></think>",
        "Checking.<tool_call>get_current_date</tool_call>",
        "stop",
        GLM_TOOLS,
        "Checking.",
        "",
        [("get_current_date", {})],
    ),
    "vllm_glm47_multiple": (
        "glm47",
        "<|assistant|></think>",
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Beijing</arg_value></tool_call>"
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Shanghai</arg_value></tool_call>",
        "stop",
        GLM_TOOLS,
        "",
        "",
        [("get_weather", {"city": "Beijing"}), ("get_weather", {"city": "Shanghai"})],
    ),
    "vllm_glm47_whitespace_content_none": (
        "glm47",
        "<|assistant|></think>",
        "  \n  <tool_call>get_current_date</tool_call>",
        "stop",
        GLM_TOOLS,
        "",
        "",
        [("get_current_date", {})],
    ),
    # vLLM tests/tool_parsers/test_hermes_tool_parser.py and tests/reasoning/test_qwen3_reasoning_parser.py
    "vllm_qwen3_reasoning": ("qwen3", "<|im_start|>assistant\n", "<think>abc</think>xyz", "stop", [], "xyz", "abc", []),
    "vllm_qwen3_no_think": ("qwen3", "<|im_start|>assistant\n", "abc", "stop", [], "abc", "", []),
    "vllm_qwen3_prefilled_think": (
        "qwen3",
        "<|im_start|>assistant\n<think>\n",
        "abc</think>xyz",
        "stop",
        [],
        "xyz",
        "abc",
        [],
    ),
    "vllm_hermes_single": (
        "qwen3",
        "<|im_start|>assistant\n",
        '<tool_call>\n{"name": "get_current_weather", "arguments": '
        '{"city": "Dallas", "state": "TX", "unit": "fahrenheit"}}\n</tool_call>',
        "stop",
        [],
        "",
        "",
        [("get_current_weather", {"city": "Dallas", "state": "TX", "unit": "fahrenheit"})],
    ),
    "vllm_hermes_parallel_with_content": (
        "qwen3",
        "<|im_start|>assistant\n",
        'Checking both.\n<tool_call>\n{"name": '
        '"get_weather", "arguments": {"city": "Dallas"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_weather", "arguments": {"city": "Orlando"}}\n</tool_call>',
        "stop",
        [],
        "Checking both.\n\n",
        "",
        [("get_weather", {"city": "Dallas"}), ("get_weather", {"city": "Orlando"})],
    ),
    "vllm_hermes_arguments_first": (
        "qwen3",
        "<|im_start|>assistant\n",
        '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>',
        "stop",
        [],
        "",
        "",
        [("f", {"a": 1})],
    ),
    "vllm_hermes_invalid_json_is_content": (
        "qwen3",
        "<|im_start|>assistant\n",
        "<tool_call>{not json}</tool_call>",
        "stop",
        [],
        "<tool_call>{not json}</tool_call>",
        "",
        [],
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_peer_case(case):
    fmt, prompt, text, finish, tools, content, reasoning, calls = CASES[case]
    result = assert_every_split_matches(fmt, prompt, text, finish, tools=tools or [tool("declared")])
    assert (result["content"], result["reasoning"], calls_of(result)) == (content, reasoning, calls)
