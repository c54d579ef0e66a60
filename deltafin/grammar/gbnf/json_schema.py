"""JSON Schema as GBNF, written as JSON (the `json` style of a structural tag's `json_schema` format).

Laid out as xgrammar lays it out, so that what xgrammar accepts for a tool's arguments this accepts too:
properties in declared order, required ones present, optional ones skippable, no undeclared keys unless
`additionalProperties` allows them (an object schema without `properties` takes any object), whitespace between
tokens as llama.cpp's own JSON grammar bounds it (`SPACE`: nothing, one space, or one or two newlines and at
most 20 spaces or tabs; deltafin.grammar.whitespace gives xgrammar's grammars the same rule).
Enforced: type (and type lists, `nullable`), properties / required / additionalProperties, items / minItems /
maxItems, enum, const, anyOf / oneOf, a one-element allOf, $ref into $defs / definitions (recursion
included), string minLength / maxLength / pattern, integer minimum / maximum (and the exclusive forms),
a non-negative minimum of a number (no sign).
Not enforced, the value is only typed: other bounds of non-integer numbers, multipleOf, `format`,
uniqueItems, min/maxProperties, and length or item bounds above `MAX_COUNT` (llama.cpp expands `x{m,n}`
into n rules). Integers have at most 16 digits and fractions 16, exponents 4.
Anything else that constrains a value is a ValueError: a grammar that silently dropped it would be a lie.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from deltafin.grammar.gbnf.excluding import JSON_STRING, excluding
from deltafin.grammar.gbnf.integers import bounds, integer_range
from deltafin.grammar.gbnf.regex import regex_expr
from deltafin.grammar.gbnf.rules import EMPTY, Rules, char_class, literal
from deltafin.protocol.sampling import MAX_INDENT, MAX_NEWLINES

MAX_COUNT = 256
_STRING_CHAR = f"({char_class(JSON_STRING.forbid, negate=True)} | {JSON_STRING.escape})"
_UNSUPPORTED = (
    "not",
    "if",
    "then",
    "else",
    "patternProperties",
    "prefixItems",
    "contains",
    "dependentSchemas",
    "dependentRequired",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
    "additionalItems",
    "$dynamicRef",
    "minContains",
    "maxContains",
)
_TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")


def _bounds(schema: Mapping[str, Any], low_key: str, high_key: str) -> tuple[int, int | None]:
    low, high = schema.get(low_key, 0), schema.get(high_key)
    if not isinstance(low, int) or low < 0 or (high is not None and (not isinstance(high, int) or high < low)):
        raise ValueError(f"{low_key} / {high_key} must be non-negative integers, low <= high")
    if low > MAX_COUNT:
        low = 0  # see the module docstring: a bound this large is not enforced
    if high is not None and high > MAX_COUNT:
        high = None
    return low, high


#: llama.cpp's SPACE_RULE (common/json-schema-to-grammar.cpp), the whitespace between two JSON tokens
SPACE = f'("" | " " | "\\n"{{1,{MAX_NEWLINES}}} [ \\t]{{0,{MAX_INDENT}}})'


def _repeat(low: int, high: int | None) -> str:
    return f"{{{low},}}" if high is None else f"{{{low},{high}}}"


class JsonGrammar:
    def __init__(
        self,
        rules: Rules,
        *,
        root: Mapping[str, Any] | bool,
        excludes: tuple[str, ...] = (),
    ) -> None:
        """excludes: substrings no free string (a value without pattern, a key) may contain, as written."""
        self.rules = rules
        self.root = root
        self.excludes = excludes
        self.ws = rules.add("ws", SPACE)
        self._refs: dict[str, str] = {}

    # -- any JSON value --------------------------------------------------------------------------------------

    def string(self) -> str:
        if self.rules.markers or self.excludes:  # control-token markers stay out of strings, as in xgrammar
            return self.rules.add(
                "json-string", f'"\\"" {excluding(self.rules, self.excludes, [chr(34)], JSON_STRING)}'
            )
        return self.rules.add("json-string", f'"\\"" {_STRING_CHAR}* "\\""')

    def number(self, *, unsigned: bool = False) -> str:
        whole = integer_range(0 if unsigned else None, None)
        return self.rules.add("json-number", f'{whole} ("." [0-9]{{1,16}})? ([eE] [+\\-]? [0-9]{{1,4}})?')

    def any_value(self) -> str:
        if ("any-json", self.ws) not in self.rules.built:
            self.rules.built[("any-json", self.ws)] = value = self.rules.reserve("json-value")
            ws, key = self.ws, self.string()
            obj = self.rules.add(
                "json-object",
                f'"{{" {ws} ({key} {ws} ":" {ws} {value} ({ws} "," {ws} {key} {ws} ":" {ws} {value})*)? {ws} "}}"',
            )
            arr = self.rules.add("json-array", f'"[" {ws} ({value} ({ws} "," {ws} {value})*)? {ws} "]"')
            self.rules.define(value, f'{obj} | {arr} | {key} | {self.number()} | "true" | "false" | "null"')
        return self.rules.built[("any-json", self.ws)]

    # -- a value under a schema ------------------------------------------------------------------------------

    def value(self, schema: Mapping[str, Any] | bool) -> str:
        if schema is True:
            return self.any_value()
        if schema is False or not isinstance(schema, Mapping):
            raise ValueError(
                f"schema {schema!r} admits no value" if schema is False else f"schema {schema!r} is not an object"
            )
        for key in _UNSUPPORTED:
            if key in schema:
                raise ValueError(f"JSON Schema keyword {key!r} is not supported in a grammar for llama-server")
        if "$ref" in schema:
            return self.ref(schema["$ref"])
        if "const" in schema:
            return literal(json.dumps(schema["const"], ensure_ascii=False))
        if "enum" in schema:
            if not isinstance(schema["enum"], list) or not schema["enum"]:
                raise ValueError("enum must be a non-empty array")
            texts = [json.dumps(v, ensure_ascii=False) for v in schema["enum"]]
            # as xgrammar: a string alternative holding an excluded text is dropped
            kept = [t for t in texts if not (t.startswith('"') and any(e in t[1:-1] for e in self.excludes))]
            if not kept:
                raise ValueError(f"every enum value contains an excluded text {list(self.excludes)}")
            return self.rules.add("enum", " | ".join(map(literal, kept)))
        for key in ("anyOf", "oneOf"):
            if key in schema:
                if not isinstance(schema[key], list) or not schema[key]:
                    raise ValueError(f"{key} must be a non-empty array")
                return self.rules.add("alt", " | ".join(self.value(sub) for sub in schema[key]))
        if "allOf" in schema:
            parts = schema["allOf"]
            if not isinstance(parts, list) or len(parts) != 1 or not isinstance(parts[0], Mapping):
                raise ValueError("allOf is supported with exactly one schema")
            rest = {k: v for k, v in schema.items() if k != "allOf"}
            return self.value({**rest, **parts[0]})
        kind = schema.get("type")
        if schema.get("nullable") is True and kind != "null":
            return self.rules.add("alt", f'{self.value({**schema, "nullable": False})} | "null"')
        if isinstance(kind, list):
            if not kind:
                raise ValueError("type must not be an empty array")
            return self.rules.add("alt", " | ".join(self.value({**schema, "type": t}) for t in kind))
        if kind is None:
            kind = "object" if "properties" in schema else "array" if "items" in schema else None
        if kind is None:
            return self.any_value()
        if kind not in _TYPES:
            raise ValueError(f"type {kind!r} is not a JSON Schema type")
        return getattr(self, f"_{kind}")(schema)

    def ref(self, ref: Any) -> str:
        if ref not in self._refs:
            self._refs[ref] = name = self.rules.reserve("ref-" + str(ref).rsplit("/", 1)[-1])
            self.rules.define(name, self.value(self._resolve(ref)))
        return self._refs[ref]

    def _resolve(self, ref: Any) -> Any:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise ValueError(f"$ref {ref!r}: only references inside the schema (#/...) are supported")
        node: Any = self.root
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, Mapping) or part not in node:
                raise ValueError(f"$ref {ref!r} points at nothing")
            node = node[part]
        return node

    # -- per type --------------------------------------------------------------------------------------------

    def _null(self, schema: Mapping[str, Any]) -> str:
        return '"null"'

    def _boolean(self, schema: Mapping[str, Any]) -> str:
        return '("true" | "false")'

    def _integer(self, schema: Mapping[str, Any]) -> str:
        low, high = bounds(schema, integer=True)  # whole numbers (rounded inward) or None
        whole = [None if bound is None else int(bound) for bound in (low, high)]
        return self.rules.add("json-integer", integer_range(*whole))

    def _number(self, schema: Mapping[str, Any]) -> str:
        low, _ = bounds(schema, integer=False)
        return self.number(unsigned=low is not None and low >= 0)

    def _string(self, schema: Mapping[str, Any]) -> str:
        if isinstance(schema.get("pattern"), str):
            return self.rules.add("pattern", f'"\\"" {regex_expr(schema["pattern"], list(JSON_STRING.forbid))} "\\""')
        low, high = _bounds(schema, "minLength", "maxLength")
        if (low, high) == (0, None):
            return self.string()
        return self.rules.add("string", f'"\\"" {_STRING_CHAR}{_repeat(low, high)} "\\""')

    def _array(self, schema: Mapping[str, Any]) -> str:
        item = self.value(schema.get("items", True))
        low, high = _bounds(schema, "minItems", "maxItems")
        ws = self.ws
        if high == 0:
            return self.rules.add("array", f'"[" {ws} "]"')
        more = f'({ws} "," {ws} {item}){_repeat(max(low - 1, 0), None if high is None else high - 1)}'
        items = f"{item} {more}" if low > 0 else f"({item} {more})?"
        return self.rules.add("array", f'"[" {ws} {items} {ws} "]"')

    def _object(self, schema: Mapping[str, Any]) -> str:
        properties = schema.get("properties") or {}
        if not isinstance(properties, Mapping):
            raise ValueError("properties must be an object")
        extra = schema.get("additionalProperties", not properties)
        if not properties and extra is not False:
            extra = True if extra is None else extra
        required = set(schema.get("required") or ())
        missing = required - set(properties)
        if missing and extra is False:
            raise ValueError(
                f"required properties {sorted(missing)} are not declared and additionalProperties is false"
            )
        ws = self.ws
        pairs = [
            (literal(json.dumps(k, ensure_ascii=False)), self.value(v), k in required) for k, v in properties.items()
        ]
        extra_pair = None if extra is False else (self.string(), self.value(True if extra is True else extra), False)
        body = self._members(pairs, extra_pair)
        return self.rules.add("object", f'"{{" {ws} {body} {ws} "}}"')

    def _members(self, pairs: list[tuple[str, str, bool]], extra: tuple[str, str, bool] | None) -> str:
        """Declared members in order; commas only between present ones, so the tail is built from the end:
        `first` is the rest when nothing was written yet, `after` the rest once something was."""
        ws, comma = self.ws, f'{self.ws} "," {self.ws}'
        if extra is None:
            first, after = EMPTY, EMPTY
        else:
            kv = self.rules.add("member", f'{extra[0]} {ws} ":" {ws} {extra[1]}')
            first = self.rules.add("members", f"({kv} ({comma} {kv})*)?")
            after = self.rules.add("members", f"({comma} {kv})*")
        for key, value, required in reversed(pairs):
            kv = self.rules.add("member", f'{key} {ws} ":" {ws} {value}')
            new_first = f"{kv} {after}" if required else f"{kv} {after} | {first}"
            new_after = f"{comma} {kv} {after}" if required else f"{comma} {kv} {after} | {after}"
            first, after = self.rules.add("members", new_first), self.rules.add("members", new_after)
        return first
