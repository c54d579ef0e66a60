"""Kimi K3 XTML channels: `<|open|>NAME attrs<|sep|>BODY<|close|>NAME<|sep|>`. Reasoning and tool calls are
channels of one grammar, read by one parser and forced by one structural tag.

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

Forced calls, as deltafin.prompt.xtml renders them in history:

    [reasoning]<|close|>think<|sep|>  or  <|close|>response<|sep|>      (closes the channel the prompt opened)
    <|open|>tools<|sep|>
      <|open|>call tool="NAME" index="N"<|sep|>
        <|open|>argument key="K" type="T"<|sep|>VALUE<|close|>argument<|sep|>...
      <|close|>call<|sep|>...
    <|close|>tools<|sep|><|close|>message<|sep|>

T is the value's JSON type as K3's encoder names it (`string`: raw text; `number` for integers and floats alike;
anything else: JSON). With thinking on, an empty response channel stands between the reasoning and the tools, as
K3's encoder writes every assistant turn with calls. xgrammar's builtin "kimi_k3" tag is not used: it pads
values with whitespace, and its response channel before the tools takes any text, so a model could talk its
way past a forced call. Arguments are laid out by deltafin.markup.xml_args.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from deltafin.markup.base import Call, Markup, ReasoningMarkers, XmlArgumentStyle, register
from deltafin.markup.chain import BlankContentBesideCalls
from deltafin.markup.formats import Format, const, one_of, regex, sequence, structural_tag, tag, think_prefix
from deltafin.markup.formats import calls as one_or_more
from deltafin.markup.parsing import (
    IdFactory,
    OutputParser,
    ParsedDelta,
    ToolCallDelta,
    random_call_id,
    released_at_finish,
    split_at_marker,
)
from deltafin.markup.selection import ForcedCalls
from deltafin.markup.values import json_fragment, typed_value
from deltafin.markup.xml_args import any_key, json_value, per_property, raw_text

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
        self._value: list[str] = []  # a non-string argument's text, in pieces (joined once: a long one stays linear)
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
                self._value.append(text)
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
            self._value = []
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
                value = typed_value("".join(self._value), self._arg_type)
                out.tool_calls.append(ToolCallDelta(self._index, arguments=json.dumps(value, ensure_ascii=False)))
        elif name == "call" and self._in_call:
            out.tool_calls.append(
                ToolCallDelta(self._index, arguments="}" if self._args else "" if self._raw else "{}")
            )
            self._in_call = False

    def finish(self, finish_reason: str) -> ParsedDelta:
        held, self._held = self._held, ""
        out = ParsedDelta()
        if self._ended or held.startswith((OPEN, CLOSE)):
            return out  # a header cut off after its marker: never text
        self._text(released_at_finish(held, (OPEN, CLOSE, END), finish_reason), out)
        if (
            self._stack
            and self._stack[-1] == "argument"
            and self._in_call
            and self._arg_type != "string"
            and self._value
        ):
            out.tool_calls.append(ToolCallDelta(self._index, arguments="".join(self._value)))  # a cut value, as written
        return out


# -- the forced grammar -------------------------------------------------------------------------------------

_MARKERS = (OPEN, CLOSE, SEP)
_ARG_END = f"{CLOSE}argument{SEP}"
#: JSON-schema type -> the type K3's encoder writes (an integer is a `number`)
TYPE_NAMES = {
    "string": "string",
    "integer": "number",
    "number": "number",
    "boolean": "boolean",
    "object": "object",
    "array": "array",
    "null": "null",
}
_JSON_TYPES = ("integer", "number", "boolean", "null", "array", "object")
_TYPE_NAMES = ("number", "boolean", "null", "array", "object")


def _attr(value: str) -> str:
    return value.replace("&", "&amp;").replace('"', "&quot;")


def _value(schema: Mapping[str, Any]) -> Format:
    """`T"<|sep|>VALUE<|close|>argument<|sep|>`, after `type="`."""
    kind = schema.get("type")
    if kind == "string":
        return tag(f'string"{SEP}', raw_text(schema, _MARKERS), _ARG_END)
    if kind in _JSON_TYPES:
        return tag(f'{TYPE_NAMES[kind]}"{SEP}', json_value(schema, _MARKERS), _ARG_END)
    # No single declared type: raw text as a string, or a JSON value under the schema with its type named.
    return one_of(
        tag(f'string"{SEP}', raw_text({}, _MARKERS), _ARG_END),
        sequence(regex("|".join(_TYPE_NAMES)), tag(f'"{SEP}', json_value(schema, _MARKERS), _ARG_END)),
    )


def _argument(key: str, schema: Mapping[str, Any]) -> Format:
    return sequence(const(f'{OPEN}argument key="{_attr(key)}" type="'), _value(schema))


_ANY_ARGUMENT = sequence(const(f'{OPEN}argument key="'), any_key(), const('" type="'), _value({}))


def _written(value: Any) -> tuple[str, str]:
    """(type name, value text) as K3's encoder writes an argument."""
    if isinstance(value, str):
        return "string", value
    kind = (
        "null"
        if value is None
        else "boolean"
        if isinstance(value, bool)
        else "number"
        if isinstance(value, (int, float))
        else "array"
        if isinstance(value, list)
        else "object"
    )
    return kind, json.dumps(value, ensure_ascii=False)


class Xtml(Markup):
    name = "xtml"
    markers = (OPEN, CLOSE, SEP, END)
    gbnf_style = XmlArgumentStyle("kimi_k3_xml", f'{OPEN}argument key="', '" type="', f'"{SEP}', _ARG_END, TYPE_NAMES)
    prompt_endings = {"enabled": f"{OPEN}think{SEP}", "disabled": f"{OPEN}response{SEP}"}

    def output_parser(
        self,
        *,
        prompt_text: str,
        tools: Sequence[Any],
        calls_allowed: bool,
        new_id: IdFactory,
        forced: ForcedCalls | None = None,
    ) -> OutputParser:
        parser = KimiK3Parser(channels=starting_channels(prompt_text), calls_allowed=calls_allowed, new_id=new_id)
        return BlankContentBesideCalls(parser) if calls_allowed else parser

    def reasoning(self, prompt_text: str) -> str:
        """The prompt opens think (thinking on, any effort attribute) or response; K3 never opens think itself."""
        tail = prompt_text.rstrip()
        return "disabled" if tail.endswith(f"{OPEN}response{SEP}") else "enabled"

    def reasoning_markers(self) -> ReasoningMarkers:
        """Only a prompt opens think; K3 writes the response channel after it, before any answer or call."""
        end = f"{CLOSE}think{SEP}"
        return ReasoningMarkers(start=None, ends=(end,), forced=f"{end}{OPEN}response{SEP}")

    def _opened(self, reasoning: str, after_thinking: str) -> Format | None:
        """Reasoning (if the prompt opened think) up to the response channel, `after_thinking` following it."""
        if reasoning != "enabled":
            return None
        return sequence(think_prefix("enabled", "", f"{CLOSE}think{SEP}", (OPEN, CLOSE)), const(after_thinking))

    def calls(self, forced: ForcedCalls, reasoning: str) -> dict[str, Any]:
        """reasoning: "enabled" when the prompt opened the think channel, else the response channel is open."""
        tags = [
            tag(
                f'{OPEN}call tool="{_attr(f.name)}" index="',
                sequence(regex(r"[0-9]{1,4}"), const(f'"{SEP}'), per_property(f.schema, _argument, _ANY_ARGUMENT)),
                f"{CLOSE}call{SEP}",
            )
            for f in forced.functions
        ]
        opened = self._opened(reasoning, f"{OPEN}response{SEP}{CLOSE}response{SEP}") or const(f"{CLOSE}response{SEP}")
        return structural_tag(
            sequence(
                opened,
                const(f"{OPEN}tools{SEP}"),
                one_or_more(tags, "", single=forced.single),
                const(f"{CLOSE}tools{SEP}{CLOSE}message{SEP}"),
            )
        )

    def answer(self, content: Format, reasoning: str) -> dict[str, Any]:
        """Reasoning (if the prompt opened think), then `content` as the whole response channel."""
        opened = self._opened(reasoning, f"{OPEN}response{SEP}")
        return structural_tag(sequence(opened, content, const(f"{CLOSE}response{SEP}{CLOSE}message{SEP}")))

    def write(
        self,
        calls: Sequence[Call],
        *,
        reasoning: str = "disabled",
        thought: str = "",
        forced: ForcedCalls | None = None,
    ) -> str:
        opened = (
            f"{thought}{CLOSE}think{SEP}{OPEN}response{SEP}{CLOSE}response{SEP}"
            if reasoning == "enabled"
            else f"{CLOSE}response{SEP}"
        )
        body = "".join(
            f'{OPEN}call tool="{_attr(name)}" index="{index}"{SEP}'
            + "".join(
                f'{OPEN}argument key="{_attr(key)}" type="{kind}"{SEP}{text}{_ARG_END}'
                for key, (kind, text) in ((k, _written(v)) for k, v in args.items())
            )
            + f"{CLOSE}call{SEP}"
            for index, (name, args) in enumerate(calls, start=1)
        )
        return f"{opened}{OPEN}tools{SEP}{body}{CLOSE}tools{SEP}{CLOSE}message{SEP}"


XTML = register(Xtml())
