"""The XML styles of a structural tag's `json_schema` format: an object's properties written one per element.

    glm_xml:      <arg_key>KEY</arg_key><arg_value>VALUE</arg_value>
    kimi_k3_xml:  <|open|>argument key="KEY" type="TYPE"<|sep|>VALUE<|close|>argument<|sep|>

As xgrammar's styles: whitespace (bounded) before each element, after the last and between GLM's key and value
elements; a string value is raw text up to the element's end (no padding), any other value is JSON under its
schema with whitespace around it; K3 names `integer` values `number`. Declared properties come in order,
required ones always; undeclared keys (`[a-zA-Z_][a-zA-Z0-9_]*`) only where additionalProperties allows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

from deltafin.grammar.gbnf.excluding import excluding
from deltafin.grammar.gbnf.json_schema import JsonGrammar
from deltafin.grammar.gbnf.rules import EMPTY, Rules

_XML_KEY = "[a-zA-Z_] [a-zA-Z0-9_]*"
_K3_TYPES = {"string": "string", "integer": "number", "number": "number", "boolean": "boolean", "object": "object",
             "array": "array", "null": "null"}


@dataclass(frozen=True)
class _Style:
    key_open: str
    key_close: str
    value_open: str
    value_close: str
    typed: bool  # K3 writes the value's type between key and value


STYLES = {
    "glm_xml": _Style("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", typed=False),
    "kimi_k3_xml": _Style('<|open|>argument key="', '" type="', '"<|sep|>', "<|close|>argument<|sep|>", typed=True),
}


def xml_arguments(rules: Rules, json_grammar: JsonGrammar, schema: Mapping[str, Any] | bool, style: str,
                  excludes: tuple[str, ...]) -> str:
    if style not in STYLES:
        raise ValueError(f"json_schema style {style!r} has no GBNF form (supported: json, {', '.join(STYLES)})")
    if schema is True:
        schema = {"type": "object"}
    if not isinstance(schema, Mapping) or schema.get("type", "object") != "object":
        raise ValueError(f"the {style} style writes an object's properties; the schema is not an object")
    return _Writer(rules, json_grammar, STYLES[style], excludes).arguments(schema)


class _Writer:
    def __init__(self, rules: Rules, json_grammar: JsonGrammar, style: _Style, excludes: tuple[str, ...]) -> None:
        self.rules, self.json, self.style, self.excludes = rules, json_grammar, style, excludes

    def arguments(self, schema: Mapping[str, Any]) -> str:
        properties = schema.get("properties") or {}
        extra = schema.get("additionalProperties", not properties)
        ws = self.json.ws
        parts = []
        for key, sub in properties.items():
            element = self.element(self.rules.text(key), sub if isinstance(sub, Mapping) else {})
            parts.append(element if key in set(schema.get("required") or ()) else f"({element})?")
        if extra is not False:
            key = self.rules.add("xml-key", _XML_KEY)
            parts.append(f"({self.element(key, extra if isinstance(extra, Mapping) else {})})*")
        return self.rules.add("xml-arguments", " ".join([*parts, ws]) if parts else ws)

    def element(self, key: str, schema: Mapping[str, Any]) -> str:
        s, ws = self.style, self.json.ws
        head = f"{ws} {self.rules.text(s.key_open)} {key} {self.rules.text(s.key_close)}"
        kind = schema.get("type")
        if not s.typed:
            value = self.string_value() if kind == "string" else self.json_value(schema)
            return self.rules.add("xml-element", f"{head} {ws} {self.rules.text(s.value_open)} {value}")
        if kind in _K3_TYPES:
            value = self.string_value() if kind == "string" else self.json_value(schema)
            type_name = json.dumps(_K3_TYPES[kind])
            return self.rules.add("xml-element", f"{head} {type_name} {self.rules.text(s.value_open)} {value}")
        # no single type: the element names the one it writes
        others = " | ".join(json.dumps(t) for t in dict.fromkeys(_K3_TYPES.values()) if t != "string")
        opened = self.rules.text(s.value_open)
        return self.rules.add(
            "xml-element",
            f'{head} ("string" {opened} {self.string_value()} | ({others}) {opened} {self.json_value(schema)})',
        )

    def string_value(self) -> str:
        return excluding(self.rules, self.excludes, [self.style.value_close])

    def json_value(self, schema: Mapping[str, Any]) -> str:
        ws = self.json.ws
        return self.rules.add("xml-json", f"{ws} {self.json.value(schema)} {ws} {self.rules.text(self.style.value_close)}")
