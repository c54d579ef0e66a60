"""Which calls a request forces: tool_choice "required" (one or more of the tools) or a named function
(exactly that one). "auto", "none" and no tool_choice force nothing."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ForcedFunction:
    name: str
    #: the arguments' JSON schema; a tool without parameters, or with strict=false, takes any JSON object
    schema: Mapping[str, Any]


@dataclass(frozen=True)
class ForcedCalls:
    functions: tuple[ForcedFunction, ...]
    #: exactly one call (named tool_choice, or parallel_tool_calls=false)
    single: bool


def _field(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)


def _function(tool: Any) -> ForcedFunction:
    function = _field(tool, "function")
    parameters = _field(function, "parameters")
    if parameters is None or _field(function, "strict") is False:
        parameters = {"type": "object"}
    return ForcedFunction(_field(function, "name"), parameters)


def named_choice(tool_choice: Any) -> str | None:
    """The function name of `{"type": "function", "function": {"name": N}}`, else None."""
    if isinstance(tool_choice, Mapping):
        function = tool_choice.get("function")
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            return function["name"]
    return None


def forced_calls(
    tools: Sequence[Any] | None, tool_choice: Any, *, parallel_tool_calls: bool | None = None
) -> ForcedCalls | None:
    """None when nothing is forced. ValueError when the named function is not among `tools`."""
    if not tools or tool_choice in (None, "auto", "none"):
        return None
    functions = [_function(tool) for tool in tools]
    if tool_choice == "required":
        return ForcedCalls(tuple(functions), single=parallel_tool_calls is False)
    name = named_choice(tool_choice)
    if name is None:
        return None  # shapes validation lets through but that force nothing
    chosen = [f for f in functions if f.name == name]
    if not chosen:
        raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
    return ForcedCalls((chosen[0],), single=True)
