"""Tool calls read back from the JSON that deltafin.grammar.forced_json forces on families without a tool-call
syntax: either one call's bare arguments (`name` given), or an array of `{"name": ..., "arguments": {...}}`.

Arguments stream as the model writes them: a call's head (id, name) goes out as soon as its name is complete,
then every character of its arguments object. The output is grammar-constrained, so the scanner only tracks
what it needs: strings, nesting depth, and the keys of each call object.
"""

from __future__ import annotations

import json

from deltafin.prompt.parsers.base import IdFactory, ParsedDelta, ToolCallDelta


class ForcedJsonCallParser:
    def __init__(self, new_id: IdFactory, *, name: str | None = None) -> None:
        self._new_id = new_id
        self._name = name  # the bare-arguments shape: this function's
        self._index = 0
        self._started = False
        # the array shape's scanner
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._string: list[str] = []
        self._key: str | None = None
        self._after_colon = False
        self._call_name: str | None = None
        self._in_arguments = False
        self._held: list[str] = []  # argument text seen before the call's name (not in this grammar's order)

    def feed(self, text: str) -> ParsedDelta:
        if self._name is not None:
            return self._bare(text)
        out = ParsedDelta()
        fragment: list[str] = []
        for char in text:
            self._scan(char, out, fragment)
        self._flush(out, fragment)
        return out

    def finish(self, finish_reason: str) -> ParsedDelta:
        if self._name is not None and not self._started and finish_reason == "stop":
            return self._bare("{}")  # nothing written: a call without arguments
        return ParsedDelta()

    def _bare(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        if not self._started:
            self._started = True
            out.tool_calls.append(ToolCallDelta(0, self._new_id(0, self._name), self._name, ""))
        if text:
            out.tool_calls.append(ToolCallDelta(0, arguments=text))
        return out

    def _flush(self, out: ParsedDelta, fragment: list[str]) -> None:
        if fragment:
            out.tool_calls.append(ToolCallDelta(self._index, arguments="".join(fragment)))
            fragment.clear()

    def _head(self, out: ParsedDelta, fragment: list[str]) -> None:
        self._flush(out, fragment)
        out.tool_calls.append(ToolCallDelta(self._index, self._new_id(self._index, self._call_name), self._call_name, ""))
        if self._held:
            fragment.extend(self._held)
            self._held.clear()

    def _scan(self, char: str, out: ParsedDelta, fragment: list[str]) -> None:
        if self._in_arguments:
            (fragment if self._call_name is not None else self._held).append(char)
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
                if self._depth == 2:
                    self._string_done(out, fragment)
            if self._depth == 2 and self._in_string:
                self._string.append(char)
            return
        if char == '"':
            self._in_string = True
            self._string = ['"']
            return
        if char in "{[":
            self._depth += 1
            if self._depth == 3 and self._after_colon and self._key == "arguments" and char == "{":
                self._in_arguments = True
                (fragment if self._call_name is not None else self._held).append(char)
        elif char in "}]":
            self._depth -= 1
            if self._depth == 2 and self._in_arguments:
                self._in_arguments = False
            elif self._depth == 1:  # a call object closed
                self._flush(out, fragment)
                self._index += 1
                self._call_name = None
                self._key = None
                self._after_colon = False
        elif self._depth == 2 and char == ":":
            self._after_colon = True
        elif self._depth == 2 and char == ",":
            self._after_colon = False

    def _string_done(self, out: ParsedDelta, fragment: list[str]) -> None:
        try:
            value = json.loads("".join(self._string) + '"')
        except json.JSONDecodeError:
            value = "".join(self._string)[1:]
        if not self._after_colon:
            self._key = value
        elif self._key == "name":
            self._call_name = value
            self._head(out, fragment)
