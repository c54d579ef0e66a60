"""Hermes-style tool calls (Qwen2.5, Qwen3): a JSON object per call between tags, after a `<think>` block.

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The call is reported once its name is read; its `arguments` object then streams as the model writes it
(the call's closing brace held back until the call ends). A body that does not start `{"name": ...,
"arguments": ...` is read as a whole at `</tool_call>`; one that is not a JSON object with a name stays
content (the model's output is kept). A call without a name is dropped; a call cut by max_tokens keeps the
arguments it had. Text between and around calls is content.

Forced, calls are written `<tool_call>\\n{"name": "NAME", "arguments": {JSON}}\\n</tool_call>`, joined by a
newline: the same strings as xgrammar's builtin "qwen_3" tag; ours lets no text stand before a required call.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from deltafin.markup.base import Call, register
from deltafin.markup.formats import Format, call_arguments, tag
from deltafin.markup.formats import calls as one_or_more
from deltafin.markup.parsing import (
    IdFactory,
    ParsedDelta,
    ToolCallDelta,
    random_call_id,
    released_at_finish,
    split_at_marker,
)
from deltafin.markup.selection import ForcedCalls
from deltafin.markup.think import END, START, ThinkMarkup

CALL_BEGIN, CALL_END = "<tool_call>", "</tool_call>"
# The head of a call, up to the first non-space character of its arguments (so the match never depends on
# how the text was chunked).
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')
_TAIL = re.compile(r"\s*\}?\s*\Z")  # what may be the call object's own closing brace

_TEXT, _HEAD_STATE, _ARGS, _NAMELESS = "text", "head", "args", "nameless"


class HermesToolParser:
    def __init__(self, new_id: IdFactory = random_call_id) -> None:
        self._new_id = new_id
        self._state = _TEXT
        self._held = ""
        self._body = ""
        self._index = -1

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        buffer = self._held + text
        self._held = ""
        while buffer:
            if self._state == _TEXT:
                before, marker, buffer = split_at_marker(buffer, (CALL_BEGIN,))
                out.content += before
                if marker is None:
                    self._held = buffer
                    return out
                self._state, self._body = _HEAD_STATE, ""
            elif self._state == _HEAD_STATE:
                before, marker, after = split_at_marker(buffer, (CALL_END,))
                self._body += before
                head = _HEAD.match(self._body)
                if head is not None:
                    buffer = self._body[head.end() :] + (marker or "") + after
                    self._begin(json.loads(f'"{head.group(1)}"'), out)
                elif marker is not None:
                    self._whole(self._body, out)
                    buffer, self._state = after, _TEXT
                else:
                    self._held = after
                    return out
            else:  # _ARGS, _NAMELESS
                before, marker, after = split_at_marker(buffer, (CALL_END,))
                if marker is None:
                    tail = _TAIL.search(before)
                    assert tail is not None  # the pattern matches an empty tail
                    self._arguments(before[: tail.start()], out)
                    self._held = before[tail.start() :] + after
                    return out
                self._arguments(re.sub(r"\s*\}\s*\Z", "", before, count=1), out)
                buffer, self._state = after, _TEXT
        return out

    def _begin(self, name: str, out: ParsedDelta) -> None:
        if not name.strip():
            self._state = _NAMELESS
            return
        self._index += 1
        out.tool_calls.append(ToolCallDelta(self._index, self._new_id(self._index, name), name, ""))
        self._state = _ARGS

    def _arguments(self, text: str, out: ParsedDelta) -> None:
        if text and self._state == _ARGS:
            out.tool_calls.append(ToolCallDelta(self._index, arguments=text))

    def _whole(self, body: str, out: ParsedDelta) -> None:
        try:
            call = json.loads(body)
        except (json.JSONDecodeError, ValueError):
            call = None
        name = call.get("name") if isinstance(call, dict) else None
        if not isinstance(name, str):
            out.content += CALL_BEGIN + body + CALL_END
            return
        if not name.strip():
            return
        arguments = call.get("arguments", call.get("parameters", {}))
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        self._index += 1
        out.tool_calls.append(ToolCallDelta(self._index, self._new_id(self._index, name), name, ""))
        out.tool_calls.append(ToolCallDelta(self._index, arguments=arguments))

    def finish(self, finish_reason: str) -> ParsedDelta:
        held = released_at_finish(self._held, (CALL_BEGIN, CALL_END), finish_reason)
        out = ParsedDelta()
        if self._state == _TEXT:
            out.content = held
        elif self._state == _ARGS:  # a call cut short keeps its partial arguments
            tail, _, partial = split_at_marker(self._held, (CALL_END,))
            self._arguments(tail + released_at_finish(partial, (CALL_END,), finish_reason), out)
        self._held = ""
        return out


class Hermes(ThinkMarkup):
    name = "hermes"
    markers = (START, END, CALL_BEGIN, CALL_END)
    call_openers = (CALL_BEGIN,)
    reasoning_excludes = (START, END, CALL_BEGIN)

    def tool_parser(self, tools: Sequence[Any], new_id: IdFactory) -> HermesToolParser:
        return HermesToolParser(new_id)

    def call_formats(self, forced: ForcedCalls) -> list[Format]:
        tags = [
            tag(
                f'{CALL_BEGIN}\n{{"name": {json.dumps(f.name)}, "arguments": ',
                call_arguments(dict(f.schema), self.markers),
                f"}}\n{CALL_END}",
            )
            for f in forced.functions
        ]
        return [one_or_more(tags, "\n", single=forced.single)]

    def write_calls(self, calls: Sequence[Call]) -> str:
        return "\n".join(
            f'{CALL_BEGIN}\n{{"name": {json.dumps(name)}, "arguments": {json.dumps(dict(args))}}}\n{CALL_END}'
            for name, args in calls
        )


HERMES = register(Hermes())
