"""The XML styles of a structural tag's `json_schema` format: an object's properties written one per element.
Each style belongs to a markup (its `gbnf_style`, deltafin.markup), e.g.

    glm_xml:      <arg_key>KEY</arg_key><arg_value>VALUE</arg_value>                         (deltafin.markup.glm)
    kimi_k3_xml:  <|open|>argument key="KEY" type="TYPE"<|sep|>VALUE<|close|>argument<|sep|>  (deltafin.markup.xtml)

As xgrammar's styles: whitespace (bounded) before each element, after the last and between GLM's key and value
elements; a string value (string type, or an enum / const of strings) is raw text up to the element's end (no
padding), any other value is JSON under its schema with whitespace around it, and a value whose schema says
nothing is either; a typed style names the type as its markup does (K3: `integer` values are `number`).
Declared properties come in order, required ones always; undeclared keys (`[a-zA-Z_][a-zA-Z0-9_]*`) only where
additionalProperties allows. These styles are for a structural tag that names one: Deltafin's own grammars lay
arguments out themselves (deltafin.markup.xml_args), without the padding.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from deltafin.grammar.gbnf.excluding import excluding
from deltafin.grammar.gbnf.json_schema import JsonGrammar
from deltafin.grammar.gbnf.regex import regex_expr
from deltafin.grammar.gbnf.rules import Rules, literal
from deltafin.markup import MARKUPS, XmlArgumentStyle

_XML_KEY = "[a-zA-Z_] [a-zA-Z0-9_]*"
#: keywords that make a schema more than "anything" (without them a value is xgrammar's `xml_any`)
_CONSTRAINING = ("type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "properties", "items", "pattern")
#: style name -> the markup's style
STYLES = {m.gbnf_style.name: m.gbnf_style for m in MARKUPS.values() if m.gbnf_style is not None}


def xml_arguments(rules: Rules, json_grammar: JsonGrammar, schema: Mapping[str, Any] | bool, style: str) -> str:
    if style not in STYLES:
        raise ValueError(f"json_schema style {style!r} has no GBNF form (supported: json, {', '.join(STYLES)})")
    if schema is True:
        schema = {"type": "object"}
    if not isinstance(schema, Mapping) or schema.get("type", "object") != "object":
        raise ValueError(f"the {style} style writes an object's properties; the schema is not an object")
    return _Writer(rules, json_grammar, STYLES[style]).arguments(schema)


class _Writer:
    def __init__(self, rules: Rules, json_grammar: JsonGrammar, style: XmlArgumentStyle) -> None:
        self.rules, self.json, self.style = rules, json_grammar, style

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
        opened = self.rules.text(s.value_open)
        if s.type_names is None:
            return self.rules.add("xml-element", f"{head} {ws} {opened} {self.value(schema)}")
        return self.rules.add("xml-element", f"{head} {self.type_name(schema)} {opened} {self.value(schema)}")

    def type_name(self, schema: Mapping[str, Any]) -> str:
        names = self.style.type_names or {}
        if _is_string(schema):
            return json.dumps(names["string"])
        if schema.get("type") in names:
            return json.dumps(names[schema["type"]])
        return "(" + " | ".join(json.dumps(t) for t in dict.fromkeys(names.values())) + ")"

    def value(self, schema: Mapping[str, Any]) -> str:
        """The value and the element's end: raw text for a string, JSON (padded) for anything else, and for a
        schema that says nothing either a raw string or a JSON array / object (xgrammar's `xml_any`)."""
        close, ws = self.rules.text(self.style.value_close), self.json.ws
        if _is_string(schema):
            return self.raw_string(schema)
        if not any(k in schema for k in _CONSTRAINING):
            structured = (
                f"{ws} ({self.json.value({'type': 'array'})} | {self.json.value({'type': 'object'})}) {ws} {close}"
            )
            return self.rules.add("xml-any", f"{self.raw_string({})} | {structured}")
        return self.rules.add("xml-json", f"{ws} {self.json.value(schema)} {ws} {close}")

    def raw_string(self, schema: Mapping[str, Any]) -> str:
        close = self.rules.text(self.style.value_close)
        if "const" in schema:
            return f"{literal(schema['const'])} {close}"
        if "enum" in schema:
            return self.rules.add("xml-enum", "(" + " | ".join(literal(v) for v in schema["enum"]) + f") {close}")
        if isinstance(schema.get("pattern"), str):
            return f"{regex_expr(schema['pattern'])} {close}"
        return excluding(self.rules, self.json.excludes, [self.style.value_close])


def _is_string(schema: Mapping[str, Any]) -> bool:
    """Written raw: a string type, or a const / enum of strings only."""
    if schema.get("type") == "string":
        return True
    values = [schema["const"]] if "const" in schema else schema.get("enum")
    return isinstance(values, list) and bool(values) and all(isinstance(v, str) for v in values)
