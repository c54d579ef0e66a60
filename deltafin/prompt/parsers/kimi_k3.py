"""Kimi K3 XTML channels: `<|open|>NAME attrs<|sep|>BODY<|close|>NAME<|sep|>`.

Text in `think` is reasoning, text in `response` is the answer; a `tools` channel holds `call` spans
(`tool="NAME" index="N"`) with `argument` spans (`key="K" type="T"`): `type="string"` values are raw text,
other types JSON. Attribute values unescape `&quot;` and `&amp;`. The prompt decides the starting channel
(`...<|open|>think<|sep|>` with thinking on, `...<|open|>response<|sep|>` with it off); opening the channel
that is already open (the model repeating the prompt's opener) is dropped. Reasoning still open at the end
stays reasoning. The message ends at `<|close|>message<|sep|>`: `<|end_of_msg|>` and whatever follows are
not content. Without calls allowed (no tools declared, or tool_choice "none") a `tools` channel is dropped
whole, as SGLang does: XTML markers are control tokens, never content. A call without a tool name is
dropped. A header cut off by max_tokens is dropped, never leaked into content. A call's arguments written as
a `json` span (K3's encoder renders arguments that are not valid JSON that way) are the call's arguments as
written. `type="number"` values (K3 names integers so) are JSON, read as written.
"""

from __future__ import annotations

import json
import re

from deltafin.prompt.parsers.base import IdFactory, ParsedDelta, ToolCallDelta, random_call_id, released_at_finish, split_at_marker
from deltafin.prompt.parsers.values import json_fragment, typed_value

OPEN, CLOSE, SEP, END = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
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

    def __init__(self, *, channels: list[str], calls_allowed: bool = True, new_id: IdFactory = random_call_id) -> None:
        self._stack = list(channels)
        self._calls_allowed = calls_allowed
        self._new_id = new_id
        self._ended = False  # the message closed: nothing after it is part of the answer
        self._held = ""
        self._index = -1
        self._in_call = False  # inside a call that is reported (named, and calls allowed)
        self._args = 0
        self._arg_type = "string"
        self._value = ""
        self._raw = False  # the call's arguments came as a raw `json` span

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        buffer = self._held + text
        self._held = ""
        while buffer and not self._ended:
            before, marker, after = split_at_marker(buffer, (OPEN, CLOSE, END))
            self._text(before, out)
            if marker is None:
                self._held = after
                return out
            if marker == END:
                buffer = after
                continue
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
        elif top == "argument":
            if not self._in_call:
                return
            if self._arg_type == "string":
                out.tool_calls.append(ToolCallDelta(self._index, arguments=json_fragment(text)))
            else:
                self._value += text
        elif top == "json":
            if self._in_call:
                out.tool_calls.append(ToolCallDelta(self._index, arguments=text))
        elif top in ("tools", "call"):
            return  # layout whitespace between spans
        elif top == "message" and not text.strip():
            return
        else:
            out.content += text  # response channel, or text outside any channel

    def _open(self, header: str, out: ParsedDelta) -> None:
        name, _, attr_text = header.strip().partition(" ")
        if self._stack and self._stack[-1] == name and name in ("think", "response"):
            return  # the model repeated the opener the prompt already wrote
        attrs = {key: unescape(value) for key, value in _ATTR.findall(attr_text)}
        self._stack.append(name)
        if name == "call":
            self._args = 0
            self._raw = False
            tool = attrs.get("tool", "").strip()
            self._in_call = self._calls_allowed and bool(tool)
            if self._in_call:
                self._index += 1
                out.tool_calls.append(ToolCallDelta(self._index, self._new_id(self._index, tool), tool, ""))
        elif name == "json" and self._in_call:
            self._raw = True
        elif name == "argument" and self._in_call:
            self._arg_type = attrs.get("type", "string")
            self._value = ""
            opening = "{" if self._args == 0 else ", "
            self._args += 1
            quote = '"' if self._arg_type == "string" else ""
            key = json_fragment(attrs.get("key", ""))
            out.tool_calls.append(ToolCallDelta(self._index, arguments=f'{opening}"{key}": {quote}'))

    def _close(self, name: str, out: ParsedDelta) -> None:
        if name in self._stack:
            while self._stack and self._stack.pop() != name:
                pass
        if name == "message":
            self._ended = True
        elif name == "argument" and self._in_call:
            if self._arg_type == "string":
                out.tool_calls.append(ToolCallDelta(self._index, arguments='"'))
            else:
                value = typed_value(self._value, self._arg_type)
                out.tool_calls.append(ToolCallDelta(self._index, arguments=json.dumps(value, ensure_ascii=False)))
        elif name == "call" and self._in_call:
            out.tool_calls.append(ToolCallDelta(self._index, arguments="}" if self._args else "" if self._raw else "{}"))
            self._in_call = False

    def finish(self, finish_reason: str) -> ParsedDelta:
        held, self._held = self._held, ""
        out = ParsedDelta()
        if self._ended or held.startswith((OPEN, CLOSE)):
            return out  # a header cut off after its marker: never text
        self._text(released_at_finish(held, (OPEN, CLOSE, END), finish_reason), out)
        if self._stack and self._stack[-1] == "argument" and self._in_call and self._arg_type != "string" and self._value:
            out.tool_calls.append(ToolCallDelta(self._index, arguments=self._value))  # a cut value, as written
        return out
