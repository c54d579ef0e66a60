"""Responses tools -> chat tool definitions, and the names calls come back under.

- `function` tools (the flat Responses form: name, description, parameters, strict beside `type`) are served.
- `namespace` groups (Codex sends one) are expanded into their functions. The prompt names each one
  `NAMESPACE__NAME` (Codex's own flat spelling), so two groups may hold functions of one name; a call the model
  makes comes back as OpenAI's API returns it: `name` the function's own name, `namespace` the group's.
- Hosted tools (web search, file search, code interpreter, ...) run on OpenAI's side; Deltafin cannot run them.
  With `server.responses.unsupported_tools=drop` (the default) they are left out of the prompt and named in the
  `x-deltafin-dropped-tools` header and the log (an agent that always sends web_search keeps working); with
  `reject` they are a 400 naming the tool.
- Any other tool type (custom, local_shell, shell, apply_patch, ...) is a 400 naming it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deltafin.errors import InvalidRequestError
from deltafin.protocol.chat import FunctionDefinition, ToolDefinition

#: tool types that OpenAI runs on its own side
HOSTED = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "web_search_2025_08_26",
        "file_search",
        "code_interpreter",
        "computer",
        "computer_use",
        "computer_use_preview",
        "image_generation",
        "mcp",
        "tool_search",
    }
)
NAMESPACE_DELIMITER = "__"


def flat_name(namespace: str | None, name: str) -> str:
    """The name a namespaced function has in the prompt (Codex's canonical flat name)."""
    if namespace is None:
        return name
    return f"{namespace.rstrip('_')}{NAMESPACE_DELIMITER}{name.lstrip('_')}"


@dataclass
class ServedTools:
    definitions: list[ToolDefinition] = field(default_factory=list)
    #: hosted tool types left out of the prompt, in request order, each once
    dropped: list[str] = field(default_factory=list)
    #: prompt name -> (the function's own name, its namespace) for namespaced functions
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)

    def reported(self, prompt_name: str) -> tuple[str, str | None]:
        """The (name, namespace) a call of `prompt_name` is returned under."""
        name, namespace = self.namespaced.get(prompt_name, (prompt_name, None))
        return name, namespace

    def prompt_name(self, name: str, namespace: str | None) -> str:
        return flat_name(namespace, name)


def served_tools(tools: list[Any] | None, *, unsupported: str) -> ServedTools:
    served = ServedTools()
    seen: set[str] = set()
    for i, tool in enumerate(tools or ()):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            _add(served, seen, _function(tool, where, None, None), where)
        elif kind == "namespace":
            namespace = tool.get("name")
            if not isinstance(namespace, str) or not namespace:
                raise InvalidRequestError(f"{where}.name: a namespace needs a name", param=f"{where}.name")
            inner = tool.get("tools")
            if not isinstance(inner, list):
                raise InvalidRequestError(f"{where}.tools: a namespace holds a list of tools", param=f"{where}.tools")
            for j, member in enumerate(inner):
                member_where = f"{where}.tools[{j}]"
                if not isinstance(member, dict) or member.get("type") != "function":
                    raise InvalidRequestError(
                        f"{member_where}.type: only function tools are supported in a namespace",
                        param=f"{member_where}.type",
                    )
                definition = _function(member, member_where, namespace, tool.get("description"))
                served.namespaced[definition.function.name] = (member["name"], namespace)
                _add(served, seen, definition, member_where)
        elif kind in HOSTED:
            if unsupported == "reject":
                raise InvalidRequestError(
                    f"{where}: the hosted tool {kind!r} runs on OpenAI's side and is not available on this server",
                    param=f"{where}.type",
                )
            if kind not in served.dropped:
                served.dropped.append(kind)
        else:
            raise InvalidRequestError(
                f"{where}.type: tools of type {kind!r} are not supported by this server "
                "(supported: function, namespace)",
                param=f"{where}.type",
            )
    return served


def _add(served: ServedTools, seen: set[str], definition: ToolDefinition, where: str) -> None:
    name = definition.function.name
    if name in seen:
        raise InvalidRequestError(f"{where}.name: two tools are called {name!r}", param=f"{where}.name")
    seen.add(name)
    served.definitions.append(definition)


def _function(tool: dict[str, Any], where: str, namespace: str | None, group_description: Any) -> ToolDefinition:
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(f"{where}.name: a function tool needs a name", param=f"{where}.name")
    parameters = tool.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise InvalidRequestError(f"{where}.parameters: a JSON schema object", param=f"{where}.parameters")
    description = tool.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidRequestError(f"{where}.description: a string", param=f"{where}.description")
    strict = tool.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequestError(f"{where}.strict: a boolean", param=f"{where}.strict")
    if namespace is not None and isinstance(group_description, str) and group_description:
        description = f"{group_description}\n{description}" if description else group_description
    return ToolDefinition(
        function=FunctionDefinition(
            name=flat_name(namespace, name), description=description, parameters=parameters, strict=strict
        )
    )


def chat_tool_choice(choice: Any, served: ServedTools) -> tuple[Any, list[ToolDefinition]]:
    """(chat's tool_choice, the tools the model may call) for a Responses tool_choice."""
    tools = served.definitions
    if choice is None or choice in ("none", "auto", "required"):
        return choice, tools
    if isinstance(choice, str):
        raise InvalidRequestError("tool_choice must be 'none', 'auto', 'required' or an object", param="tool_choice")
    if not isinstance(choice, dict):
        raise InvalidRequestError("tool_choice must be a string or an object", param="tool_choice")
    kind = choice.get("type")
    if kind == "function":
        name = choice.get("name")
        if not isinstance(name, str):
            raise InvalidRequestError("tool_choice.name: the function to call", param="tool_choice.name")
        return {
            "type": "function",
            "function": {"name": _known(served, name, choice.get("namespace"), "tool_choice.name")},
        }, tools
    if kind == "allowed_tools":
        mode = choice.get("mode", "auto")
        if mode not in ("auto", "required"):
            raise InvalidRequestError("tool_choice.mode must be 'auto' or 'required'", param="tool_choice.mode")
        allowed = set()
        for j, entry in enumerate(choice.get("tools") or ()):
            where = f"tool_choice.tools[{j}]"
            if not isinstance(entry, dict) or entry.get("type") != "function" or not isinstance(entry.get("name"), str):
                raise InvalidRequestError(f"{where}: only function tools can be allowed here", param=where)
            allowed.add(_known(served, entry["name"], entry.get("namespace"), f"{where}.name"))
        return mode, [t for t in tools if t.function.name in allowed]
    raise InvalidRequestError(f"tool_choice of type {kind!r} is not supported by this server", param="tool_choice.type")


def _known(served: ServedTools, name: str, namespace: Any, param: str) -> str:
    """The prompt name of a function a client names (with or without its namespace)."""
    names = {t.function.name for t in served.definitions}
    candidate = flat_name(namespace if isinstance(namespace, str) else None, name)
    if candidate in names:
        return candidate
    matches = [flat for flat, (own, _) in served.namespaced.items() if own == name]
    if len(matches) == 1:
        return matches[0]
    raise InvalidRequestError(f"{param}: no function tool called {name!r} among tools", param=param)
