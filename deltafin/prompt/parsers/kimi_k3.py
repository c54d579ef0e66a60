"""Kimi K3 XTML channels: `<|open|>NAME attrs<|sep|>BODY<|close|>NAME<|sep|>`.

Text in `think` is reasoning, text in `response` is the answer; a `tools` channel holds `call` spans
(`tool="NAME" index="N"`) with `argument` spans (`key="K" type="T"`): `type="string"` values are raw text,
other types JSON. Attribute values unescape `&quot;` and `&amp;`. The prompt decides the starting channel
(`...<|open|>think<|sep|>` with thinking on, `...<|open|>response<|sep|>` with it off). A header cut off by
max_tokens is dropped, never leaked into content.
"""

from __future__ import annotations

import json
import re

from deltafin.prompt.parsers.base import IdFactory, ParsedDelta, ToolCallDelta, random_call_id, split_at_marker
from deltafin.prompt.parsers.glm import typed_value

OPEN, CLOSE, SEP = "<|open|>", "<|close|>", "<|sep|>"
_MAX_HEADER = 1024
_ATTR = re.compile(r'(\w+)="([^"]*)"')


def unescape(value: str) -> str:
    return value.replace("&quot;", '"').replace("&amp;", "&")


def starting_channels(prompt_text: str) -> list[str]:
    """The channels the generation prompt leaves open."""
    tail = prompt_text.rstrip()
    if tail.endswith(f"{OPEN}think{SEP}"):
        return ["message", "think"]
    if tail.endswith(f"{OPEN}response{SEP}"):
        return ["message", "response"]
    return []


class KimiK3Parser:
    """Reasoning and tool calls together: in XTML they are channels of one grammar."""

    def __init__(self, *, channels: list[str], new_id: IdFactory = random_call_id) -> None:
        self._stack = list(channels)
        self._prefilled_think = bool(channels) and channels[-1] == "think"
        self._think_closed = False
        self._reasoning_seen = ""
        self._new_id = new_id
        self._held = ""
        self._index = -1
        self._args = 0
        self._arg_type = "string"
        self._value = ""

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        buffer = self._held + text
        self._held = ""
        while buffer:
            before, marker, after = split_at_marker(buffer, (OPEN, CLOSE))
            self._text(before, out)
            if marker is None:
                self._held = after
                return out
            header, sep, rest = after.partition(SEP)
            if not sep:
                if len(after) <= _MAX_HEADER:
                    self._held = marker + after  # the header is not complete yet
                else:  # no header after all: it was text
                    self._text(marker + after, out)
                return out
            buffer = rest
            if marker == OPEN:
                self._open(header, out)
            else:
                self._close(header.strip(), out)
        return out

    def _text(self, text: str, out: ParsedDelta) -> None:
        if not text:
            return
        top = self._stack[-1] if self._stack else None
        if top == "think":
            out.reasoning += text
            self._reasoning_seen += text
        elif top == "argument":
            if self._arg_type == "string":
                out.tool_calls.append(ToolCallDelta(self._index, arguments=json.dumps(text, ensure_ascii=False)[1:-1]))
            else:
                self._value += text
        elif top in ("tools", "call"):
            return  # layout whitespace between spans
        elif top == "message" and not text.strip():
            return
        else:
            out.content += text  # response channel, or text outside any channel

    def _open(self, header: str, out: ParsedDelta) -> None:
        name, _, attr_text = header.strip().partition(" ")
        attrs = {key: unescape(value) for key, value in _ATTR.findall(attr_text)}
        self._stack.append(name)
        if name == "call":
            self._index += 1
            self._args = 0
            name = attrs.get("tool", "")
            out.tool_calls.append(ToolCallDelta(self._index, self._new_id(self._index, name), name, ""))
        elif name == "argument":
            self._arg_type = attrs.get("type", "string")
            self._value = ""
            opening = "{" if self._args == 0 else ", "
            self._args += 1
            quote = '"' if self._arg_type == "string" else ""
            key = json.dumps(attrs.get("key", ""), ensure_ascii=False)
            out.tool_calls.append(ToolCallDelta(self._index, arguments=f"{opening}{key}: {quote}"))

    def _close(self, name: str, out: ParsedDelta) -> None:
        if name in self._stack:
            while self._stack and self._stack.pop() != name:
                pass
        if name == "think":
            self._think_closed = True
        elif name == "argument":
            if self._arg_type == "string":
                out.tool_calls.append(ToolCallDelta(self._index, arguments='"'))
            else:
                value = json.dumps(typed_value(self._value, self._arg_type), ensure_ascii=False)
                out.tool_calls.append(ToolCallDelta(self._index, arguments=value))
        elif name == "call":
            out.tool_calls.append(ToolCallDelta(self._index, arguments="}" if self._args else "{}"))

    def finish(self, finish_reason: str) -> ParsedDelta:
        held, self._held = self._held, ""
        out = ParsedDelta()
        if held and not held.startswith((OPEN, CLOSE)) and not OPEN.startswith(held) and not CLOSE.startswith(held):
            self._text(held, out)
        if self._prefilled_think and not self._think_closed and finish_reason == "stop" and self._reasoning_seen:
            return ParsedDelta(content=self._reasoning_seen, reasoning_retracted=True)
        return out
