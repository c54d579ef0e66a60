"""A structural tag (Deltafin's format vocabulary, `deltafin.markup.formats`) as a GBNF grammar.

The same document goes to xgrammar on the local engine and to vLLM / SGLang as is; llama-server reads GBNF,
so each format becomes rules here. `any_text` inside a `tag` runs up to the tag's end (the end string is one
of the texts it may not contain); anywhere else it is text free of its `excludes`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from deltafin.grammar.gbnf.excluding import excluding
from deltafin.grammar.gbnf.json_schema import JsonGrammar
from deltafin.grammar.gbnf.regex import regex_expr
from deltafin.grammar.gbnf.rules import EMPTY, Rules
from deltafin.grammar.gbnf.xml_style import xml_arguments

Format = Mapping[str, Any]


def structural_tag_to_gbnf(tag: Mapping[str, Any] | str, special_tokens: Mapping[str, int] | None = None) -> str:
    """The GBNF grammar of `tag` (`{"type": "structural_tag", "format": {...}}`, as a dict or JSON text).

    special_tokens: the model's added tokens, text -> id; literal text that spells one is matched as that
    token (`<[ID]>`), so the model must emit the real control token rather than spell it in pieces.
    ValueError names what has no GBNF form."""
    try:
        return _translate(tag, special_tokens or {})
    except (TypeError, AttributeError, KeyError, RecursionError) as exc:
        # a schema of the wrong shape somewhere deep (`"required": 5`) or nested past Python's stack: the
        # client's input, so a 400 upstream of here, never a 500
        raise ValueError(f"structural tag could not be translated ({type(exc).__name__}: {exc})") from exc


def _translate(tag: Mapping[str, Any] | str, special_tokens: Mapping[str, int]) -> str:
    if isinstance(tag, str):
        try:
            tag = json.loads(tag)
        except json.JSONDecodeError as exc:
            raise ValueError(f"structural tag is not JSON: {exc}") from exc
    if (
        not isinstance(tag, Mapping)
        or tag.get("type") != "structural_tag"
        or not isinstance(tag.get("format"), Mapping)
    ):
        raise ValueError('a structural tag is {"type": "structural_tag", "format": {...}}')
    text = json.dumps(tag, ensure_ascii=False)
    # the control tokens this structure writes are the ones a parser splits on: free text must not hold them
    rules = Rules(special_tokens, [t for t in special_tokens if t in text])
    return rules.render(_Emitter(rules).expr(tag["format"]))


class _Emitter:
    def __init__(self, rules: Rules) -> None:
        self.rules = rules
        self._kinds: dict[str, Callable[[Format], str]] = {
            "const_string": lambda f: self.rules.text(_str(f, "value")),
            "regex": lambda f: regex_expr(_str(f, "pattern")),
            "sequence": lambda f: self.rules.add("seq", " ".join(self.expr(e) for e in _list(f, "elements")) or EMPTY),
            "or": lambda f: self.rules.add("or", " | ".join(self.expr(e) for e in _list(f, "elements", nonempty=True))),
            "optional": lambda f: f"({self.expr(_fmt(f, 'content'))})?",
            "star": lambda f: f"({self.expr(_fmt(f, 'content'))})*",
            "plus": lambda f: f"({self.expr(_fmt(f, 'content'))})+",
            "repeat": self.repeat,
            "token": lambda f: self.rules.token(f.get("token")),  # type: ignore[arg-type]  # token() refuses what is not an id or special
            "any_text": lambda f: excluding(self.rules, self.excludes(f)),
            "tag": self.tag,
            "tags_with_separator": self.tags_with_separator,
            "json_schema": self.json_schema,
        }

    def expr(self, fmt: Any) -> str:
        if not isinstance(fmt, Mapping):
            raise ValueError(f"structural tag format must be an object, got {fmt!r}")
        kind = fmt.get("type")
        if kind not in self._kinds:
            raise ValueError(f"structural tag format {kind!r} has no GBNF form for llama-server")
        return self._kinds[kind](fmt)

    def excludes(self, fmt: Format) -> list[str]:
        if fmt.get("max_chars") is not None or fmt.get("max_tokens") is not None:
            raise ValueError("any_text with max_chars / max_tokens has no GBNF form for llama-server")
        return [_checked_str(e, "excludes") for e in fmt.get("excludes") or ()]

    def boundary(self, value: Any) -> list[str] | str:
        """A tag's begin / end: text (one or several ends), or a token format."""
        if isinstance(value, Mapping):
            return self.expr(value)
        if isinstance(value, list):
            return [_checked_str(v, "end") for v in value]
        return [_checked_str(value, "begin / end")]

    def tag(self, fmt: Format) -> str:
        begin, end, content = (
            self.boundary(fmt.get("begin", "")),
            self.boundary(fmt.get("end", "")),
            _fmt(fmt, "content"),
        )
        begin_expr = begin if isinstance(begin, str) else self.rules.text(begin[0])
        if content.get("type") == "any_text" and isinstance(end, list) and any(end):
            return self.rules.add("tag", f"{begin_expr} {excluding(self.rules, self.excludes(content), end)}")
        end_expr = end if isinstance(end, str) else " | ".join(self.rules.text(e) for e in end) or EMPTY
        return self.rules.add("tag", f"{begin_expr} {self.expr(content)} ({end_expr})")

    def tags_with_separator(self, fmt: Format) -> str:
        one = self.rules.add(
            "one-tag", " | ".join(self.tag(_checked_tag(t)) for t in _list(fmt, "tags", nonempty=True))
        )
        at_least_one, first_only = bool(fmt.get("at_least_one")), bool(fmt.get("stop_after_first"))
        if first_only:
            return one if at_least_one else f"({one})?"
        sep = self.rules.text(_str(fmt, "separator")) if fmt.get("separator") else ""
        many = f"{one} ({sep} {one})*" if sep else f"{one}+"
        return self.rules.add("tags", many if at_least_one else f"({many})?")

    def repeat(self, fmt: Format) -> str:
        low, high = fmt.get("min"), fmt.get("max")
        if not isinstance(low, int) or not isinstance(high, int) or low < 0 or (high != -1 and high < low):
            raise ValueError("repeat needs integer min >= 0 and max >= min (or -1)")
        return f"({self.expr(_fmt(fmt, 'content'))}){{{low},{'' if high == -1 else high}}}"

    def json_schema(self, fmt: Format) -> str:
        schema = fmt.get("json_schema")
        if not isinstance(schema, (Mapping, bool)):
            raise ValueError("json_schema format needs a schema object")
        excludes = tuple(_checked_str(e, "excludes") for e in fmt.get("excludes") or ())
        # max_whitespace_cnt is xgrammar's nearest bound; GBNF writes llama.cpp's own rule (JsonGrammar.ws)
        json_grammar = JsonGrammar(self.rules, root=schema, excludes=excludes)
        style = fmt.get("style", "json")
        return json_grammar.value(schema) if style == "json" else xml_arguments(self.rules, json_grammar, schema, style)


def _checked_str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"structural tag {what} must be a string, got {value!r}")
    return value


def _str(fmt: Format, key: str) -> str:
    return _checked_str(fmt.get(key), key)


def _checked_tag(value: Any) -> Format:
    if not isinstance(value, Mapping) or value.get("type", "tag") != "tag":
        raise ValueError(f"tags_with_separator takes tag formats, got {value!r}")
    return value


def _list(fmt: Format, key: str, *, nonempty: bool = False) -> list[Any]:
    value = fmt.get(key)
    if not isinstance(value, list) or (nonempty and not value):
        raise ValueError(f"structural tag {fmt.get('type')} needs a list `{key}`")
    return value


def _fmt(fmt: Format, key: str) -> Format:
    value = fmt.get(key)
    if not isinstance(value, Mapping):
        raise ValueError(f"structural tag {fmt.get('type')} needs a format `{key}`")
    return value
