"""Argument values shared by the markups that write raw (not JSON-quoted) values: GLM and Kimi K3 XTML.

Which JSON-schema types a declared argument allows, how a raw value becomes a JSON value, and how text is
streamed as the inside of a JSON string.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any


def json_fragment(text: str) -> str:
    """`text` as it appears inside a JSON string literal (without the quotes)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def typed_value(raw: str, kind: str | None) -> Any:
    """A raw value as the schema types it; anything but a string is JSON if it parses, else text."""
    if kind == "string":
        return raw
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, ValueError):
        return raw


def _allowed_types(prop: Any) -> list[str]:
    """Every type a property schema allows: `type: T`, `type: [..]`, and the branches of anyOf/oneOf."""
    if not isinstance(prop, dict):
        return []
    kind = prop.get("type")
    types = (
        [kind] if isinstance(kind, str) else [k for k in kind if isinstance(k, str)] if isinstance(kind, list) else []
    )
    for key in ("anyOf", "oneOf"):
        for branch in prop.get(key) or ():
            types += _allowed_types(branch)
    return types


def argument_kind(prop: Any) -> str | None:
    """The one type a raw value is read as. A schema that allows a string keeps the raw text as that string
    (an optional string `anyOf: [{type: string}, {type: null}]` must not turn "true" into a boolean);
    otherwise the first non-null type; None when the schema names no type."""
    types = _allowed_types(prop)
    if "string" in types:
        return "string"
    return next((t for t in types if t != "null"), None)


def schema_types(tools: Sequence[Any] | None) -> dict[str, dict[str, str]]:
    """{tool name: {argument: JSON-schema type}} from OpenAI tool definitions (dicts or protocol structs)."""
    out: dict[str, dict[str, str]] = {}
    for name, props in tool_properties(tools).items():
        kinds = {key: argument_kind(prop) for key, prop in props.items()}
        out[name] = {key: kind for key, kind in kinds.items() if kind is not None}
    return out


def tool_properties(tools: Sequence[Any] | None) -> dict[str, dict[str, Any]]:
    """{tool name: its parameters' `properties`} from OpenAI tool definitions (dicts or protocol structs)."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or ():
        function = tool["function"] if isinstance(tool, dict) else tool.function
        name = function["name"] if isinstance(function, dict) else function.name
        params = (function.get("parameters") if isinstance(function, dict) else function.parameters) or {}
        out[name] = dict(params.get("properties") or {})
    return out
