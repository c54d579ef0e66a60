"""Kimi K2 tool calls:

    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{JSON}<|tool_call_end|>...<|tool_calls_section_end|>

The id is reported verbatim (it is rendered back in later turns). Tolerated deviations seen in the wild: the
singular `<|tool_call_section_begin|>`, a call without a section, ids like `call00003` or `functionsexec5`
(the name is then recovered from the declared tools), and the placeholder content `(no content)` written
before a tool section (dropped: the message has no content). Arguments stream as the model writes them.
"""

from __future__ import annotations

import re
from typing import Sequence

from deltafin.prompt.parsers.base import IdFactory, ParsedDelta, ToolCallDelta, is_partial_marker, random_call_id, split_at_marker

SECTION_BEGIN = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
SECTION_END = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
CALL_BEGIN = "<|tool_call_begin|>"
ARGS_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
ALL_MARKERS = (*SECTION_BEGIN, *SECTION_END, CALL_BEGIN, ARGS_BEGIN, CALL_END)

_ID = re.compile(r"^(?:functions\.)?(?P<name>.+?)(?::\d+)?$")

_TEXT, _SECTION, _ID_STATE, _ARGS = "text", "section", "id", "args"
PLACEHOLDER = "(no content)"


def name_from_id(call_id: str, tool_names: Sequence[str]) -> str:
    """`functions.get_weather:0` -> get_weather; odd ids fall back to the longest declared tool name inside."""
    if call_id.startswith("functions.") or ":" in call_id:
        match = _ID.match(call_id)
        if match and (not tool_names or match.group("name") in tool_names):
            return match.group("name")
    inside = [name for name in tool_names if name in call_id]
    if inside:
        return max(inside, key=len)
    return re.sub(r"\d+$", "", call_id.removeprefix("functions")).strip(".:_") or call_id


class KimiK2ToolParser:
    def __init__(self, tool_names: Sequence[str] = (), new_id: IdFactory = random_call_id) -> None:
        self._tool_names = list(tool_names)
        self._new_id = new_id
        self._state = _TEXT
        self._held = ""
        self._id = ""
        self._index = -1
        self._at_start = True

    def _placeholder(self, buffer: str) -> str | None:
        """At the start of the answer: None while it may still be `(no content)` before a section;
        else what to go on with (the placeholder dropped when a section follows it)."""
        stripped = buffer.lstrip()
        if len(stripped) < len(PLACEHOLDER):
            return None if PLACEHOLDER.startswith(stripped) else buffer
        if not stripped.startswith(PLACEHOLDER):
            return buffer
        rest = stripped[len(PLACEHOLDER) :].lstrip()
        starts = (*SECTION_BEGIN, CALL_BEGIN)
        if not rest or any(m.startswith(rest) for m in starts):
            return None
        return rest if rest.startswith(starts) else buffer

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        buffer = self._held + text
        self._held = ""
        if self._at_start:
            decided = self._placeholder(buffer)
            if decided is None:
                self._held = buffer
                return out
            self._at_start, buffer = False, decided
        while buffer:
            if self._state == _TEXT:
                before, marker, buffer = split_at_marker(buffer, (*SECTION_BEGIN, CALL_BEGIN))
                out.content += before
                if marker is None:
                    self._held = buffer
                    return out
                self._state = _SECTION if marker in SECTION_BEGIN else _ID_STATE
                self._id = ""
            elif self._state == _SECTION:
                before, marker, after = split_at_marker(buffer, (CALL_BEGIN, *SECTION_END))
                if marker is None:
                    self._held = after
                    return out
                buffer = after
                if marker == CALL_BEGIN:
                    self._state, self._id = _ID_STATE, ""
                else:
                    self._state = _TEXT
            elif self._state == _ID_STATE:
                before, marker, after = split_at_marker(buffer, (ARGS_BEGIN,))
                self._id += before
                if marker is None:
                    self._held = after
                    return out
                buffer = after
                self._index += 1
                name = name_from_id(self._id.strip(), self._tool_names) if self._id.strip() else ""
                call_id = self._id.strip() or self._new_id(self._index, name)
                out.tool_calls.append(ToolCallDelta(self._index, call_id, name, ""))
                self._state = _ARGS
            else:  # _ARGS
                before, marker, after = split_at_marker(buffer, (CALL_END, *SECTION_END))
                if before:
                    out.tool_calls.append(ToolCallDelta(self._index, arguments=before))
                if marker is None:
                    self._held = after
                    return out
                buffer = after
                self._state = _SECTION if marker == CALL_END else _TEXT
        return out

    def finish(self, finish_reason: str) -> ParsedDelta:
        held, self._held = self._held, ""
        if is_partial_marker(held, ALL_MARKERS) or self._state in (_SECTION, _ID_STATE):
            return ParsedDelta()
        if self._state == _ARGS:
            return ParsedDelta(tool_calls=[ToolCallDelta(self._index, arguments=held)] if held else [])
        return ParsedDelta(content=held)
