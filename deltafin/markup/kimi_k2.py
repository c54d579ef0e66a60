"""Kimi K2 / K2.5 / K2.6 tool calls, after a `<think>` block:

    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{JSON}<|tool_call_end|>...<|tool_calls_section_end|>

The id is reported verbatim (it is rendered back in later turns). Tolerated deviations seen in the wild: the
singular `<|tool_call_section_begin|>`, a call without a section, ids like `functionsexec5` or
`functions.NAME.0`, ids that carry no name at all (`0`, `call00003`: the name is then the one declared tool,
or the one declared tool whose parameters hold every argument, else the call is dropped: a name is never
invented), and the placeholder content `(no content)` written before a tool section (dropped: the message
has no content). Section and argument markers outside a section are control tokens, never content.
Arguments stream as the model writes them.

Forced, a section holds the calls with nothing before it: the same strings as xgrammar's builtin "kimi" tag,
but IDX is bounded to 4 digits (an unbounded `\\d+` lets a weak model write digits forever).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from deltafin.markup.base import Call, register
from deltafin.markup.formats import Format, call_arguments, const, regex, sequence, tag
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
from deltafin.markup.values import tool_properties

SECTION_BEGIN = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
SECTION_END = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
CALL_BEGIN = "<|tool_call_begin|>"
ARGS_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
ALL_MARKERS = (*SECTION_BEGIN, *SECTION_END, CALL_BEGIN, ARGS_BEGIN, CALL_END)
_STRAY = (*SECTION_END, ARGS_BEGIN, CALL_END)  # dropped where they make no sense

# functions.NAME:IDX and its relatives: the prefix, a separator and the counter are all optional.
_ID = re.compile(r"^(?:functions\.?)?(?P<name>.*?)[:._]?\d*$", re.DOTALL)
_NAMELESS = re.compile(r"^(?:functions[.:]?|call_?)?\d*$")

# _ARGS streams a named call's arguments; _INFER collects a nameless call's arguments to pick its tool.
_TEXT, _SECTION, _ID_STATE, _ARGS, _INFER = "text", "section", "id", "args", "infer"
PLACEHOLDER = "(no content)"


def name_from_id(call_id: str, tools: Mapping[str, Any]) -> str | None:
    """The function a call id names, exactly: `functions.get_weather:0` -> get_weather. None when the id
    carries no name (`0`, `call00003`); an undeclared name is still the model's call and is returned."""
    for candidate in (call_id, call_id.removeprefix("functions.")):
        if candidate in tools:
            return candidate
    if _NAMELESS.match(call_id):
        return None
    match = _ID.match(call_id)
    name = match.group("name") if match else ""
    return name or None


def infer_tool(tools: Mapping[str, Mapping[str, Any]], arguments: str) -> str | None:
    """A nameless call's tool: the only declared one, or the only one whose parameters hold every argument
    (JSON object required). Ambiguous or unreadable: None."""
    if len(tools) == 1:
        return next(iter(tools))
    try:
        keys = json.loads(arguments)
    except (json.JSONDecodeError, ValueError):
        return None
    if not isinstance(keys, dict):
        return None
    fits = [name for name, props in tools.items() if set(keys) <= set(props)]
    return fits[0] if len(fits) == 1 else None


class KimiK2ToolParser:
    def __init__(
        self, tools: Mapping[str, Mapping[str, Any]] | None = None, new_id: IdFactory = random_call_id
    ) -> None:
        """`tools`: {declared name: its parameters' properties}."""
        self._tools = dict(tools or {})
        self._new_id = new_id
        self._state = _TEXT
        self._held = ""
        self._id = ""
        self._args = ""
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

    def _head(self, call_id: str, name: str, out: ParsedDelta) -> None:
        self._index += 1
        out.tool_calls.append(ToolCallDelta(self._index, call_id or self._new_id(self._index, name), name, ""))

    def _start_call(self, out: ParsedDelta) -> None:
        call_id = self._id.strip()
        name = name_from_id(call_id, self._tools) if call_id else None
        if name is not None:
            self._head(call_id, name, out)
            self._state = _ARGS
        else:
            self._state, self._args = _INFER, ""

    def _end_inferred(self, out: ParsedDelta) -> None:
        name = infer_tool(self._tools, self._args)
        if name is not None:
            self._head(self._id.strip(), name, out)
            if self._args:
                out.tool_calls.append(ToolCallDelta(self._index, arguments=self._args))

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
                before, marker, buffer = split_at_marker(buffer, (*SECTION_BEGIN, CALL_BEGIN, *_STRAY))
                out.content += before
                if marker is None:
                    self._held = buffer
                    return out
                if marker in _STRAY:
                    continue
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
                self._start_call(out)
            else:  # _ARGS, _INFER: up to the end of the call
                before, marker, after = split_at_marker(buffer, (CALL_END, *SECTION_END))
                if self._state == _ARGS and before:
                    out.tool_calls.append(ToolCallDelta(self._index, arguments=before))
                elif self._state == _INFER:
                    self._args += before
                if marker is None:
                    self._held = after
                    return out
                if self._state == _INFER:
                    self._end_inferred(out)
                buffer = after
                self._state = _SECTION if marker == CALL_END else _TEXT
        return out

    def finish(self, finish_reason: str) -> ParsedDelta:
        held = released_at_finish(self._held, ALL_MARKERS, finish_reason)
        self._held = ""
        out = ParsedDelta()
        if self._at_start or self._state == _TEXT:
            out.content = held
        elif self._state == _ARGS and held:  # a call cut by max_tokens keeps its partial arguments
            out.tool_calls.append(ToolCallDelta(self._index, arguments=held))
        elif self._state == _INFER:
            self._args += held
            self._end_inferred(out)
        return out


class KimiK2(ThinkMarkup):
    name = "kimi_k2"
    markers = (START, END, *SECTION_BEGIN, *SECTION_END, CALL_BEGIN, ARGS_BEGIN, CALL_END)
    # A tool section opened inside reasoning ends it (seen in the wild without </think>).
    call_openers = (*SECTION_BEGIN, CALL_BEGIN)
    # Everything the parser reads as a call's start ends reasoning, so a forced output's reasoning may hold none
    # of them (a random model wrote <|tool_call_section_begin|> there, and the parser made a call of it).
    reasoning_excludes = (START, END, *call_openers)

    def tool_parser(self, tools: Sequence[Any], new_id: IdFactory) -> KimiK2ToolParser:
        return KimiK2ToolParser(tool_properties(tools), new_id)

    def call_formats(self, forced: ForcedCalls) -> list[Format]:
        tags = [
            tag(
                f"{CALL_BEGIN}functions.{f.name}:",
                sequence(regex(r"[0-9]{1,4}"), const(ARGS_BEGIN), call_arguments(dict(f.schema), self.markers)),
                CALL_END,
            )
            for f in forced.functions
        ]
        return [const(SECTION_BEGIN[0]), one_or_more(tags, "", single=forced.single), const(SECTION_END[0])]

    def write_calls(self, calls: Sequence[Call]) -> str:
        body = "".join(
            f"{CALL_BEGIN}functions.{name}:{index}{ARGS_BEGIN}{json.dumps(dict(args))}{CALL_END}"
            for index, (name, args) in enumerate(calls)
        )
        return f"{SECTION_BEGIN[0]}{body}{SECTION_END[0]}"


KIMI_K2 = register(KimiK2())
