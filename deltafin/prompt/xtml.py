"""Kimi K3's XTML prompt, built as K3's own encoder builds it (K3 ships no Jinja template: its prompt is made in
code by `encoding_k3.py::build_chat_segments` in the model repository; tests/prompt/test_k3_golden.py checks
Deltafin against a public copy of it, segment by segment and token by token).

    <|open|>message role="user"<|sep|>TEXT<|close|>message<|sep|><|end_of_msg|>

The prompt is a list of segments, each a control token or plain text, tokenized one by one: text segments
(tag names, every attribute piece, content) never become control tokens, so `<|open|>` typed by a user stays
text. In order: the tool declaration, the thinking-effort message (thinking on), the messages, a tool-choice
message (`required` / `none`), a response-format message (`json_object` / `json_schema`), the generation prompt.

Where Deltafin departs from the reference, on purpose: a `developer` message is rendered as a `system` one (the
reference drops roles it does not know; an instruction must not vanish silently); image parts are a 400 (text
only for now); errors the reference raises (`medium` effort, arguments that are not an object, a tool result
with no resolvable name) are 400s naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from deltafin.errors import InvalidRequestError
from deltafin.prompt.format import NO_OPTIONS, PromptOptions, RenderedPrompt, refuse_images, text_parts, tool_as_sent
from deltafin.prompt.plain_text import PlainText
from deltafin.protocol.chat import ChatMessage, ResponseFormat, ToolCall, ToolDefinition

OPEN, CLOSE, SEP, END = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
CONTROLS = (OPEN, CLOSE, SEP, END)
EFFORTS = ("low", "high", "max")

_TOOLS_HEADER = "# Tools\nHere are the available tools, described in JSONSchema.\n\n"
_NEW_TOOLS_HEADER = (
    "## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
    "You have access to all existing and extended tools.\nHere are the specs for the extended tools.\n\n"
)
_EFFORT_BODY = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including the response channel), "
    "supported values include `low`, `medium`, `high`, and `max`.\nNow the system is invoked with `thinking_effort={}`."
)
_TOOL_CHOICE_BODY = {
    "required": "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
    "none": "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
}
_RAW_JSON = (
    "The system is invoked with `response_format={}`.\n"
    "Your response must be raw JSON data without markdown code blocks (```json) or any additional formatting."
)


def escape(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


def compact_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def sorted_deep(value: Any) -> Any:
    """Objects with their keys sorted, at every depth (lists keep their order)."""
    if isinstance(value, dict):
        return {key: sorted_deep(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [sorted_deep(item) for item in value]
    return value


def value_type(value: Any) -> str:
    """An argument's `type` attribute: JSON's types, integers and floats alike `number`."""
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else "array"


@dataclass(frozen=True)
class Segment:
    text: str
    control: bool


class _Builder:
    def __init__(self) -> None:
        self.segments: list[Segment] = []

    def control(self, token: str) -> None:
        self.segments.append(Segment(token, True))

    def text(self, text: str) -> None:
        if text:
            self.segments.append(Segment(text, False))

    def open(self, tag: str, attrs: Iterable[tuple[str, Any]] = ()) -> None:
        self.control(OPEN)
        self.text(tag)
        for key, value in attrs:  # each piece its own segment, as the reference tokenizes them
            self.text(f" {key}")
            self.text('="')
            self.text(escape(str(value)))
            self.text('"')
        self.control(SEP)

    def close(self, tag: str) -> None:
        self.control(CLOSE)
        self.text(tag)
        self.control(SEP)

    def message(self, attrs: Iterable[tuple[str, Any]], texts: Iterable[str]) -> None:
        self.open("message", attrs)
        for text in texts:
            self.text(text)
        self.close("message")
        self.control(END)

    def system(self, kind: str, body: str) -> None:
        self.message([("role", "system"), ("type", kind)], [body.strip()])

    def tool_declaration(self, tools: list[dict[str, Any]], *, added: bool) -> None:
        header = _NEW_TOOLS_HEADER if added else _TOOLS_HEADER
        self.message(
            [("role", "system"), ("type", "tool-declare")],
            [f"{header}```json\n{compact_json(sorted_deep(tools))}\n```"],
        )


def thinking_mode(defaults: dict[str, Any], request: dict[str, Any], reasoning_effort: str | None) -> tuple[bool, str]:
    """(thinking, effort) as vLLM's K3 encoder resolves them: `thinking` (or `enable_thinking`) from the
    request's template kwargs, else the config's, else on; `reasoning_effort: "none"` turns it off, another
    value is the effort unless `thinking_effort` is given; the config's effort, else `max`."""
    thinking = request.get("thinking", request.get("enable_thinking"))
    if thinking is None:
        thinking = defaults.get("thinking", defaults.get("enable_thinking", True))
    effort, param = request.get("thinking_effort"), "chat_template_kwargs.thinking_effort"
    if reasoning_effort == "none":
        thinking = False
    elif effort is None and reasoning_effort is not None:
        effort, param = reasoning_effort, "reasoning_effort"
    if effort is None:
        effort, param = defaults.get("thinking_effort", "max"), "model.chat_template_kwargs.thinking_effort"
    if effort not in EFFORTS:
        raise InvalidRequestError(
            f'Kimi K3 supports thinking efforts {", ".join(EFFORTS)} (and reasoning_effort "none" to turn '
            f"thinking off), not {effort!r}",
            param=param,
        )
    return bool(thinking), effort


def _arguments(call: ToolCall, where: str) -> tuple[dict[str, Any], str | None]:
    """A call's arguments as an object, or (when a JSON string does not parse) the raw string for a json block."""
    arguments = call.function.arguments
    if isinstance(arguments, dict):
        return arguments, None
    if not arguments.strip():
        return {}, None
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return {}, arguments
    if not isinstance(parsed, dict):
        raise InvalidRequestError("tool call arguments must be a JSON object", param=where)
    return parsed, None


def _in_call_order(messages: Sequence[ChatMessage]) -> list[tuple[int, ChatMessage, str | None]]:
    """(original index, message, the tool it answers) with each run of tool results put in the order of the
    last assistant's calls, matched by `tool_call_id`. A run with any result that matches no call is left
    as sent, and its names are found when rendered."""
    out: list[tuple[int, ChatMessage, str | None]] = []
    calls: dict[str, tuple[int, str]] = {}
    i = 0
    while i < len(messages):
        message = messages[i]
        if message.role != "tool":
            if message.role == "assistant":
                calls = {}
                for position, call in enumerate(message.tool_calls or (), start=1):
                    if call.id is not None:
                        calls.setdefault(call.id, (position, call.function.name))
            out.append((i, message, None))
            i += 1
            continue
        run = []
        while i < len(messages) and messages[i].role == "tool":
            call_id = messages[i].tool_call_id
            run.append((i, messages[i], calls.get(call_id) if call_id is not None else None))
            i += 1
        matched = [(index, result, match) for index, result, match in run if match is not None]
        if len(matched) == len(run):
            matched.sort(key=lambda item: item[2][0])  # stable: equal positions keep their order
            out += [(index, result, match[1]) for index, result, match in matched]
        else:
            out += [(index, result, None) for index, result, _ in run]
    return out


class XtmlChatFormat:
    def __init__(self, tokenizer: Any, *, content_format: str, default_kwargs: dict[str, Any]) -> None:
        self._default_kwargs = dict(default_kwargs)
        own = getattr(tokenizer, "_encode_text_piece", None)  # K3's own tokenizer: its segment encoding exactly
        if own is not None:
            self._encode = lambda segment: list(own(segment.text, allow_special_tokens=segment.control))
            return
        ids = {token: tokenizer.convert_tokens_to_ids(token) for token in CONTROLS}
        unknown = tokenizer.convert_tokens_to_ids(tokenizer.unk_token) if tokenizer.unk_token else None
        missing = [token for token, id_ in ids.items() if id_ is None or id_ == unknown]
        if missing:
            raise ValueError(f"model.chat_format=xtml but the tokenizer has no {', '.join(missing)} token")
        plain = PlainText(tokenizer, CONTROLS)
        self._encode = lambda segment: [ids[segment.text]] if segment.control else plain.encode(segment.text)

    def render(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[ToolDefinition] | None,
        template_kwargs: dict[str, Any],
        *,
        add_generation_prompt: bool = True,
        options: PromptOptions = NO_OPTIONS,
    ) -> RenderedPrompt:
        segments = self.segments(
            messages, tools, template_kwargs, add_generation_prompt=add_generation_prompt, options=options
        )
        token_ids: list[int] = []
        for segment in segments:
            token_ids += self._encode(segment)
        return RenderedPrompt(token_ids, "".join(segment.text for segment in segments))

    def segments(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[ToolDefinition] | None,
        template_kwargs: dict[str, Any],
        *,
        add_generation_prompt: bool = True,
        options: PromptOptions = NO_OPTIONS,
    ) -> list[Segment]:
        thinking, effort = thinking_mode(self._default_kwargs, template_kwargs, options.reasoning_effort)
        out = _Builder()
        if tools:
            out.tool_declaration([tool_as_sent(t) for t in tools], added=False)
        if thinking:
            out.system("thinking-effort", _EFFORT_BODY.format(effort))
        last_calls: list[ToolCall] = []
        results = 0
        for index, message, answered in _in_call_order(messages):
            role = "system" if message.role == "developer" else message.role
            named = [("name", message.name)] if message.name else []
            if role == "assistant":
                last_calls, results = list(message.tool_calls or ()), 0
                out.open("message", [("role", "assistant"), *named])
                self._assistant(index, message, thinking, out)
                out.close("message")
                out.control(END)
            elif role == "tool":
                results += 1
                tool = answered if answered is not None else message.name
                if tool is None and results <= len(last_calls):
                    tool = last_calls[results - 1].function.name
                if tool is None:
                    raise InvalidRequestError(
                        "a tool result needs the name of its tool: a tool_call_id of the last assistant message's "
                        "calls, a `name`, or a call at its position",
                        param=f"messages[{index}]",
                    )
                out.message([("role", "tool"), ("tool", tool), ("index", results)], text_parts(index, message))
            elif role == "system" and message.tools:
                out.tool_declaration([tool_as_sent(t) for t in message.tools], added=True)
            else:
                out.message([("role", role), *named], text_parts(index, message))
        self._request_messages(options, out)
        if add_generation_prompt:
            out.open("message", [("role", "assistant")])
            out.open("think" if thinking else "response")
        return out.segments

    @staticmethod
    def _assistant(index: int, message: ChatMessage, thinking: bool, out: _Builder) -> None:
        refuse_images(index, message)
        if thinking:  # the think channel is written on every assistant turn, empty when there is no reasoning
            out.open("think")
            reasoning = message.reasoning_content or message.reasoning
            if reasoning and reasoning.strip():
                out.text(reasoning)
            out.close("think")
        out.open("response")  # always, even empty beside tool calls
        for text in text_parts(index, message):
            out.text(text)
        out.close("response")
        if not message.tool_calls:
            return
        out.open("tools")
        for position, call in enumerate(message.tool_calls, start=1):
            out.open("call", [("tool", call.function.name), ("index", position)])
            arguments, raw = _arguments(call, f"messages[{index}].tool_calls[{position - 1}].function.arguments")
            if raw is not None:
                out.open("json", [("type", "object")])
                out.text(raw)
                out.close("json")
            for key, value in arguments.items():
                out.open("argument", [("key", key), ("type", value_type(value))])
                out.text(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))
                out.close("argument")
            out.close("call")
        out.close("tools")

    @staticmethod
    def _request_messages(options: PromptOptions, out: _Builder) -> None:
        if isinstance(options.tool_choice, str) and options.tool_choice in _TOOL_CHOICE_BODY:
            out.system("tool-choice", _TOOL_CHOICE_BODY[options.tool_choice])
        response_format: ResponseFormat | None = options.response_format
        if response_format is None:
            return
        if response_format.type == "json_object":
            out.system("response-format", _RAW_JSON.format("json_object"))
        elif response_format.type == "json_schema":
            spec = response_format.json_schema
            if spec is None or spec.schema is None:
                raise InvalidRequestError(
                    "response_format of type json_schema needs json_schema.schema", param="response_format.json_schema"
                )
            schema = compact_json(sorted_deep(spec.schema))
            out.system(
                "response-format",
                _RAW_JSON.format("json_schema")
                + f"\nThe JSON data must match the following schema:\n```json\n{schema}\n```",
            )
