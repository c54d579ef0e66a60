"""GLM tool calls, after a `<think>` block. Two variants, two markups: GLM-4.5/4.6 (`glm45`) put a newline
after the name; GLM-4.7/5 (`glm47`) do not, allow zero-argument calls (`<tool_call>now</tool_call>`) and text
between and after calls:

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

Values are raw text, typed from the tool's JSON schema (`type`, a type list, `anyOf`/`oneOf`: a field that
allows a string keeps the raw text): strings stay raw (whitespace kept, never stripped), other types are
decoded as JSON. Names and keys are stripped; a call whose name is empty is dropped (no call without a
name). Arguments stream as OpenAI JSON fragments: string values character by character, other values when
complete; a call cut by max_tokens keeps the arguments it had.

Forced, the calls follow the reasoning with nothing before them; string values are raw text without the
markup's markers, other values JSON under their schema (laid out by deltafin.markup.xml_args). xgrammar's
builtin "glm_4_7" tag is not used: it has no GLM-4.5 form, its `glm_xml` style pads values with whitespace
(which the parser keeps, as GLM values must be kept), and it lets text stand before a required call.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from deltafin.markup.base import Call, XmlArgumentStyle, register
from deltafin.markup.formats import Format, const, sequence, tag
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
from deltafin.markup.values import json_fragment, schema_types, typed_value
from deltafin.markup.xml_args import any_key, json_value, per_property, raw_text

CALL_BEGIN, CALL_END = "<tool_call>", "</tool_call>"
KEY_BEGIN, KEY_END = "<arg_key>", "</arg_key>"
VALUE_BEGIN, VALUE_END = "<arg_value>", "</arg_value>"
ALL_MARKERS = (CALL_BEGIN, CALL_END, KEY_BEGIN, KEY_END, VALUE_BEGIN, VALUE_END)

_TEXT, _NAME, _BETWEEN, _KEY, _BEFORE_VALUE, _VALUE = "text", "name", "between", "key", "before_value", "value"
_NAMELESS = "nameless"  # inside a call without a name: swallowed up to its </tool_call>


class GlmToolParser:
    def __init__(
        self,
        *,
        newline_after_name: bool,
        types: dict[str, dict[str, str]] | None = None,
        new_id: IdFactory = random_call_id,
    ) -> None:
        self._name_ends = (KEY_BEGIN, CALL_END, "\n") if newline_after_name else (KEY_BEGIN, CALL_END)
        self._types = types or {}
        self._new_id = new_id
        self._state = _TEXT
        self._held = ""
        self._index = -1
        self._name = ""
        self._key = ""
        # the name, key or non-string value being read, in pieces: joined once it ends, so a long one stays linear
        self._parts: list[str] = []
        self._args = 0

    def _kind(self) -> str | None:
        return self._types.get(self._name, {}).get(self._key)

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        buffer = self._held + text
        self._held = ""
        while buffer:
            state = self._state
            if state == _TEXT:
                before, marker, buffer = split_at_marker(buffer, (CALL_BEGIN,))
                out.content += before
                if marker is None:
                    self._held = buffer
                    return out
                self._state, self._parts = _NAME, []
            elif state == _NAME:
                before, marker, after = split_at_marker(buffer, self._name_ends)
                self._parts.append(before)
                if marker is None:
                    self._held = after
                    return out
                self._name, self._args = "".join(self._parts).strip(), 0
                # A newline ends a 4.5 name; the tag that ended a 4.7 name is handled in the next state.
                buffer = after if marker == "\n" else marker + after
                if not self._name:
                    self._state = _NAMELESS
                    continue
                self._index += 1
                out.tool_calls.append(ToolCallDelta(self._index, self._new_id(self._index, self._name), self._name, ""))
                self._state = _BETWEEN
            elif state == _NAMELESS:
                _, marker, after = split_at_marker(buffer, (CALL_END,))
                if marker is None:
                    self._held = after
                    return out
                buffer, self._state = after, _TEXT
            elif state == _BETWEEN:
                stripped = buffer.lstrip()
                if not stripped:
                    return out
                before, marker, after = split_at_marker(stripped, (KEY_BEGIN, CALL_END))
                if marker is None:
                    self._held = stripped
                    return out
                buffer = after
                if marker == KEY_BEGIN:
                    self._state, self._parts = _KEY, []
                else:
                    out.tool_calls.append(ToolCallDelta(self._index, arguments="}" if self._args else "{}"))
                    self._state = _TEXT
            elif state == _KEY:
                before, marker, after = split_at_marker(buffer, (KEY_END,))
                self._parts.append(before)
                if marker is None:
                    self._held = after
                    return out
                self._key = "".join(self._parts).strip()
                buffer = after
                self._state = _BEFORE_VALUE
            elif state == _BEFORE_VALUE:
                stripped = buffer.lstrip()
                if not stripped:
                    return out
                before, marker, after = split_at_marker(stripped, (VALUE_BEGIN,))
                if marker is None:
                    self._held = stripped
                    return out
                opening = "{" if self._args == 0 else ", "
                self._args += 1
                quote = '"' if self._kind() == "string" else ""
                out.tool_calls.append(
                    ToolCallDelta(self._index, arguments=f"{opening}{json.dumps(self._key)}: {quote}")
                )
                buffer, self._parts = after, []
                self._state = _VALUE
            else:  # _VALUE: raw text, never stripped
                before, marker, after = split_at_marker(buffer, (VALUE_END,))
                if self._kind() == "string":
                    if before:
                        out.tool_calls.append(ToolCallDelta(self._index, arguments=json_fragment(before)))
                else:
                    self._parts.append(before)
                if marker is None:
                    self._held = after
                    return out
                if self._kind() == "string":
                    closing = '"'
                else:
                    closing = json.dumps(typed_value("".join(self._parts), self._kind()), ensure_ascii=False)
                out.tool_calls.append(ToolCallDelta(self._index, arguments=closing))
                buffer = after
                self._state = _BETWEEN
        return out

    def finish(self, finish_reason: str) -> ParsedDelta:
        held = released_at_finish(self._held, ALL_MARKERS, finish_reason)
        self._held = ""
        if self._state == _TEXT:
            return ParsedDelta(content=held)
        if self._state == _VALUE:  # a call cut inside a value reports what it had (the raw text of a non-string)
            partial = json_fragment(held) if self._kind() == "string" else "".join(self._parts) + held
            return ParsedDelta(tool_calls=[ToolCallDelta(self._index, arguments=partial)] if partial else [])
        return ParsedDelta()  # cut between the parts of a call: its arguments stay as streamed so far


class Glm(ThinkMarkup):
    markers = (START, END, *ALL_MARKERS)
    call_openers = (CALL_BEGIN,)
    reasoning_excludes = answer_excludes = markers
    gbnf_style = XmlArgumentStyle("glm_xml", KEY_BEGIN, KEY_END, VALUE_BEGIN, VALUE_END)

    def __init__(self, name: str, *, newline_after_name: bool) -> None:
        self.name = name
        self.newline_after_name = newline_after_name
        self._newline = "\n" if newline_after_name else ""

    def tool_parser(self, tools: Sequence[Any], new_id: IdFactory) -> GlmToolParser:
        return GlmToolParser(newline_after_name=self.newline_after_name, types=schema_types(tools), new_id=new_id)

    def _value(self, schema: Mapping[str, Any]) -> Format:
        return (
            raw_text(schema, self.markers)
            if schema.get("type") in ("string", None)
            else json_value(schema, self.markers)
        )

    def _argument(self, key: str, schema: Mapping[str, Any]) -> Format:
        nl = self._newline
        return sequence(
            const(f"{KEY_BEGIN}{key}{KEY_END}{nl}"), tag(VALUE_BEGIN, self._value(schema), f"{VALUE_END}{nl}")
        )

    def call_formats(self, forced: ForcedCalls) -> list[Format]:
        nl = self._newline
        any_argument = sequence(
            const(KEY_BEGIN),
            any_key(),
            const(f"{KEY_END}{nl}"),
            tag(VALUE_BEGIN, raw_text({}, self.markers), f"{VALUE_END}{nl}"),
        )
        tags = [
            tag(f"{CALL_BEGIN}{f.name}{nl}", per_property(f.schema, self._argument, any_argument), CALL_END)
            for f in forced.functions
        ]
        return [one_or_more(tags, nl, single=forced.single)]

    def write_calls(self, calls: Sequence[Call]) -> str:
        nl = self._newline

        def value(v: Any) -> str:
            return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)

        return nl.join(
            f"{CALL_BEGIN}{name}{nl}"
            + "".join(f"{KEY_BEGIN}{k}{KEY_END}{nl}{VALUE_BEGIN}{value(v)}{VALUE_END}{nl}" for k, v in args.items())
            + CALL_END
            for name, args in calls
        )


GLM45 = register(Glm("glm45", newline_after_name=True))
GLM47 = register(Glm("glm47", newline_after_name=False))
