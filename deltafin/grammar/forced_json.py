"""Forced tool calls for families without a tool-call syntax (the default model, `generic`): plain JSON, as vLLM
forces them on any model.

- One function and one call (a named tool_choice, or "required" with one tool and parallel_tool_calls false):
  the output is that call's arguments, a JSON object under the function's schema.
- Otherwise ("required"): a JSON array of `{"name": NAME, "arguments": {...}}` objects, each one of the tools
  with its own schema, at least one (exactly one with parallel_tool_calls false).

deltafin.prompt.parsers.forced_json reads the same two shapes back into tool calls.
"""

from __future__ import annotations

from typing import Any

from deltafin.grammar.tool_calls.selection import ForcedCalls


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
        {"type": "object", "properties": {"name": {"const": f.name}, "arguments": dict(f.schema)},
         "required": ["name", "arguments"], "additionalProperties": False}
        for f in forced.functions
    ]
    schema: dict[str, Any] = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
    if forced.single:
        schema["maxItems"] = 1
    return schema
