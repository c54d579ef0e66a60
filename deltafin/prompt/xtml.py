"""Kimi K3's XTML prompt, rendered by Deltafin (K3 ships no Jinja template; its prompt is built in code).

    <|open|>message role="user"<|sep|>TEXT<|close|>message<|sep|><|end_of_msg|>

Only the four markers are control tokens; every other character (headers, attributes, text, argument
values) is tokenized as plain text, so no message can forge a span. Deltafin's choices where the format
leaves room: declared tools are a first system message `name="tools"` holding the tools' JSON; a tool result
is `role="tool" call_id="ID"`; a call's `index` counts from 1 within its message; `thinking_effort` other than
the default `max` is an `effort` attribute on the think span; assistant history drops reasoning.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from deltafin.errors import InvalidRequestError
from deltafin.prompt.chat_format import RenderedPrompt, _arguments, _tool_dict, message_text
from deltafin.protocol.chat import ChatMessage, ToolDefinition
from deltafin.token_codec import TokenCodec

OPEN, CLOSE, SEP, END = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
EFFORTS = ("low", "high", "max")


def escape(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if value is None:
        return "null"
    return "array" if isinstance(value, list) else "object"


class _Segments:
    """The prompt as alternating control tokens and plain text."""

    def __init__(self) -> None:
        self.parts: list[tuple[str, bool]] = []

    def control(self, token: str) -> None:
        self.parts.append((token, True))

    def text(self, text: str) -> None:
        if text:
            self.parts.append((text, False))

    def open(self, channel: str, /, **attrs: Any) -> None:
        self.control(OPEN)
        self.text(channel + "".join(f' {k}="{escape(str(v))}"' for k, v in attrs.items()))
        self.control(SEP)

    def close(self, channel: str) -> None:
        self.control(CLOSE)
        self.text(channel)
        self.control(SEP)

    def span(self, channel: str, body: str, /, **attrs: Any) -> None:
        self.open(channel, **attrs)
        self.text(body)
        self.close(channel)

    def end_message(self) -> None:
        self.close("message")
        self.control(END)


class XtmlChatFormat:
    def __init__(self, tokenizer: Any, *, content_format: str, default_kwargs: dict[str, Any]) -> None:
        self._tokenizer = tokenizer
        self._codec = TokenCodec(tokenizer)
        self._default_kwargs = dict(default_kwargs)

    def render(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[ToolDefinition] | None,
        template_kwargs: dict[str, Any],
        *,
        add_generation_prompt: bool = True,
    ) -> RenderedPrompt:
        kwargs = {**self._default_kwargs, **template_kwargs}
        out = _Segments()
        if tools:
            out.open("message", role="system", name="tools")
            out.text(json.dumps([_tool_dict(t) for t in tools], ensure_ascii=False))
            out.end_message()
        for index, message in enumerate(messages):
            self._message(index, message, out)
        if add_generation_prompt:
            out.open("message", role="assistant")
            if kwargs.get("thinking", True):
                effort = kwargs.get("thinking_effort", "max")
                if effort not in EFFORTS:
                    raise InvalidRequestError(f"thinking_effort must be one of {', '.join(EFFORTS)}", param="chat_template_kwargs")
                out.open("think", **({} if effort == "max" else {"effort": effort}))
            else:
                out.open("response")
        token_ids: list[int] = []
        for text, control in out.parts:
            if control:
                token_ids.append(self._tokenizer.convert_tokens_to_ids(text))
            else:
                token_ids += self._codec.encode(text, split_special_tokens=True)
        return RenderedPrompt(token_ids, "".join(text for text, _ in out.parts))

    def _message(self, index: int, message: ChatMessage, out: _Segments) -> None:
        text = message_text(index, message)
        role = "system" if message.role == "developer" else message.role
        if role == "assistant":
            out.open("message", role="assistant")
            if text or not message.tool_calls:
                out.span("response", text)
            if message.tool_calls:
                out.open("tools")
                for position, call in enumerate(message.tool_calls, start=1):
                    out.open("call", tool=call.function.name, index=position)
                    arguments = _arguments(call.function.arguments)
                    if not isinstance(arguments, dict):
                        raise InvalidRequestError(
                            "tool call arguments must be a JSON object", param=f"messages[{index}].tool_calls"
                        )
                    for key, value in arguments.items():
                        kind = _json_type(value)
                        body = value if kind == "string" else json.dumps(value, ensure_ascii=False)
                        out.span("argument", body, key=key, type=kind)
                    out.close("call")
                out.close("tools")
            out.end_message()
        elif role == "tool":
            out.open("message", role="tool", call_id=message.tool_call_id or "")
            out.text(text)
            out.end_message()
        else:
            out.open("message", role=role)
            out.text(text)
            out.end_message()
