"""Arguments written one property at a time (K3 `argument` spans, GLM `<arg_key>/<arg_value>` pairs).

xgrammar's XML styles (`glm_xml`, `kimi_k3_xml`) allow whitespace around every value; our parsers keep string
values raw (whitespace is data, never stripped), so a padded value would reach the client. The properties are
therefore laid out here: declared properties in schema order (required ones always, optional ones maybe),
string values as raw text without the markup's markers, other values as JSON under their own schema.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from deltafin.markup.formats import Format, call_arguments, const, one_of, optional, regex, sequence, star

#: (key, property schema) -> the format of one argument
ArgumentFormat = Callable[[str, Mapping[str, Any]], Format]
#: what an undeclared key may look like when the tool declares no properties
ANY_KEY = r"[A-Za-z0-9_.\-]{1,64}"


def raw_text(schema: Mapping[str, Any], excludes: tuple[str, ...]) -> Format:
    """A string value as raw text: one of its enum values, its const, its pattern, or any text without markers."""
    if isinstance(schema.get("enum"), list) and schema["enum"] and all(isinstance(v, str) for v in schema["enum"]):
        return one_of(*(const(v) for v in schema["enum"]))
    if isinstance(schema.get("const"), str):
        return const(schema["const"])
    if isinstance(schema.get("pattern"), str):
        return regex(schema["pattern"])
    return {"type": "any_text", "excludes": list(excludes)}


def json_value(schema: Mapping[str, Any], excludes: tuple[str, ...]) -> Format:
    """A value that is not a string, as JSON under its schema, its strings without the markup's markers."""
    return call_arguments(dict(schema), excludes)


def per_property(schema: Mapping[str, Any], argument: ArgumentFormat, any_argument: Format) -> Format:
    """The arguments of a call under `schema`; any number of `any_argument` when it declares no properties."""
    properties = schema.get("properties")
    if not isinstance(properties, Mapping) or not properties:
        return star(any_argument)
    required = set(schema.get("required") or ())
    parts = []
    for key, sub in properties.items():
        one = argument(key, sub if isinstance(sub, Mapping) else {})
        parts.append(one if key in required else optional(one))
    return sequence(*parts)


def any_key() -> Format:
    return regex(ANY_KEY)
