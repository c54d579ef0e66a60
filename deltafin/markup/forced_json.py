"""Forced tool calls for families without a tool-call markup (the default model, `generic`): plain JSON, as vLLM
forces them on any model.

- One function and one call (a named tool_choice, or "required" with one tool and parallel_tool_calls false):
  the output is that call's arguments, a JSON object under the function's schema.
- Otherwise ("required"): a JSON array of `{"name": NAME, "arguments": {...}}` objects, each one of the tools
  with its own schema, at least one (exactly one with parallel_tool_calls false).

Serving sends `forced_call_schema` as a JSON-schema constraint (every engine, llama-server included, takes one
natively); `ForcedJson.calls` is the same language as a structural tag. The model is never asked to choose a
call (`chooses_calls` is false): without a forced tool_choice, tools are refused.

Arguments stream as the model writes them: a call's head (id, name) goes out as soon as its name is complete,
then every character of its arguments object. The output is grammar-constrained, so the scanner only tracks
what it needs: strings, nesting depth, and the keys of each call object.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from deltafin.markup.base import Call, Markup, register
from deltafin.markup.formats import arguments, structural_tag
from deltafin.markup.parsing import IdFactory, OutputParser, ParsedDelta, ToolCallDelta
from deltafin.markup.selection import ForcedCalls


def arguments_only(forced: ForcedCalls) -> str | None:
    """The function whose bare arguments the output is, or None when the output is an array of calls."""
    if forced.single and len(forced.functions) == 1:
        return forced.functions[0].name
    return None


def forced_call_schema(forced: ForcedCalls) -> dict[str, Any]:
    """The JSON schema the output is generated under."""
    if arguments_only(forced) is not None:
        return dict(forced.functions[0].schema)
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": f.name}, "arguments": dict(f.schema)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in forced.functions
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
        "minItems": 1,
    }
    if forced.single:
        schema["maxItems"] = 1
    return schema


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
            out.tool_calls.append(ToolCallDelta(0, self._new_id(0, self._name or ""), self._name, ""))
        if text:
            out.tool_calls.append(ToolCallDelta(0, arguments=text))
        return out

    def _flush(self, out: ParsedDelta, fragment: list[str]) -> None:
        if fragment:
            out.tool_calls.append(ToolCallDelta(self._index, arguments="".join(fragment)))
            fragment.clear()

    def _head(self, out: ParsedDelta, fragment: list[str]) -> None:
        self._flush(out, fragment)
        out.tool_calls.append(
            ToolCallDelta(self._index, self._new_id(self._index, self._call_name or ""), self._call_name, "")
        )
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


class ForcedJson(Markup):
    name = "forced_json"
    chooses_calls = False

    def output_parser(
        self,
        *,
        prompt_text: str,
        tools: Sequence[Any],
        calls_allowed: bool,
        new_id: IdFactory,
        forced: ForcedCalls | None = None,
    ) -> OutputParser:
        if forced is None:
            raise ValueError("forced JSON calls are read only where a constraint forced them")
        return ForcedJsonCallParser(new_id, name=arguments_only(forced))

    def calls(self, forced: ForcedCalls, reasoning: str) -> dict[str, Any]:
        return structural_tag(arguments(forced_call_schema(forced)))

    def write(
        self,
        calls: Sequence[Call],
        *,
        reasoning: str = "disabled",
        thought: str = "",
        forced: ForcedCalls | None = None,
    ) -> str:
        if forced is not None and arguments_only(forced) is not None:
            return json.dumps(dict(calls[0][1]))
        return json.dumps([{"name": name, "arguments": dict(args)} for name, args in calls])


FORCED_JSON = register(ForcedJson())
