"""The chat request an Anthropic Messages request is served as: one request path for both APIs, so the family's
chat format and parsers, the rules, constrained decoding, the queue and the engines are chat's.

- `tools` (`input_schema`) are chat function tools. A tool with `defer_loading` is left out of the prompt until a
  `tool_reference` in the conversation loads it (what Anthropic's tool search does; Claude Code's
  `DeferredToolPlaceholder` so never reaches the model). Anthropic's own tool types (`web_search_...`,
  `bash_...`), whose schemas only Anthropic knows, are a 400 naming the tool.
- `tool_choice`: auto -> auto, any -> required, tool -> that function, none -> none;
  `disable_parallel_tool_use` -> `parallel_tool_calls: false`. A forced call (any, tool) is enforced as on chat.
- `thinking` onto the model's thinking switch (`model.thinking_kwarg`): enabled and adaptive turn it on,
  disabled off, none leaves the model's default; `budget_tokens` becomes `thinking_token_budget`. A model
  without a thinking switch ignores it (Claude Code always sends it).
- `max_tokens` is an upper bound, cut to what the prompt leaves (Claude Code sends 32000 whatever the model).
- `stop_sequences`, `temperature`, `top_p`, `top_k` as chat's; `output_config.format` (JSON schema) as
  `response_format`.
- Accepted and ignored: `metadata`, `output_config.effort`, `thinking.display` (it shapes the answer, not the
  prompt), `cache_control` on any block (the prefix cache reuses any shared prefix by itself),
  `context_management`, `service_tier` and every other unknown field, the `anthropic-beta` header.
"""

from __future__ import annotations

from typing import Any

from deltafin.errors import InvalidRequestError
from deltafin.protocol.chat import (
    ChatCompletionRequest,
    FunctionDefinition,
    JsonSchemaFormat,
    ResponseFormat,
    ToolDefinition,
)
from deltafin.protocol.common import StreamOptions
from deltafin.protocol.messages import CountTokensRequest, MessagesRequest, OutputConfig, Tool, ToolChoice
from deltafin.serving.messages.conversation import chat_conversation

#: a client tool; other `type`s are Anthropic's own server or client tools
_CUSTOM = (None, "custom")


def chat_tools(tools: list[Tool] | None, referenced: set[str]) -> list[ToolDefinition] | None:
    if not tools:
        return None
    served = []
    for i, tool in enumerate(tools):
        if tool.type not in _CUSTOM:
            raise InvalidRequestError(
                f"tools.{i}: `{tool.type}` is one of Anthropic's own tools, which this server cannot run; declare "
                "the tool with a name and an input_schema instead",
                param=f"tools.{i}.type",
            )
        if tool.input_schema is None:
            raise InvalidRequestError(f"tools.{i}.input_schema: Field required", param=f"tools.{i}.input_schema")
        if tool.defer_loading and tool.name not in referenced:
            continue
        function = FunctionDefinition(name=tool.name, description=tool.description, parameters=tool.input_schema)
        served.append(ToolDefinition(function=function))
    return served or None


def chat_tool_choice(choice: ToolChoice | None) -> tuple[str | dict[str, Any] | None, bool | None]:
    """(chat's tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, None
    parallel = False if choice.disable_parallel_tool_use else None
    if choice.type == "tool":
        if not choice.name:
            raise InvalidRequestError("tool_choice.name: Field required for type `tool`", param="tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel


def _thinking(request: CountTokensRequest, key: str | None) -> tuple[dict[str, Any], int | None]:
    """(template kwargs, thinking token budget)."""
    thinking = request.thinking
    if thinking is None or key is None:
        return {}, None
    if thinking.type == "disabled":
        return {key: False}, None
    budget = thinking.budget_tokens if thinking.type == "enabled" else None
    return {key: True}, budget


def _response_format(config: OutputConfig | None) -> ResponseFormat | None:
    fmt = config.format if config is not None else None
    if fmt is None:
        return None
    if fmt.type != "json_schema" or fmt.schema is None:
        raise InvalidRequestError(
            'output_config.format: only {"type": "json_schema", "schema": {...}} is supported',
            param="output_config.format",
        )
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(schema=fmt.schema))


def chat_request(
    request: CountTokensRequest, *, thinking_kwarg: str | None, inline_system: bool = True
) -> ChatCompletionRequest:
    """The chat request `request` is served as (a count_tokens request: the same prompt, nothing to generate)."""
    conversation = chat_conversation(request.system, request.messages, inline_system=inline_system)
    tool_choice, parallel = chat_tool_choice(request.tool_choice)
    kwargs, budget = _thinking(request, thinking_kwarg)
    fields: dict[str, Any] = {}
    if isinstance(request, MessagesRequest):
        fields = {
            "max_tokens": request.max_tokens,
            "stop": request.stop_sequences,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "top_k": request.top_k,
            "stream": request.stream,
            "stream_options": StreamOptions(include_usage=True) if request.stream else None,
        }
    return ChatCompletionRequest(
        model=request.model,
        messages=conversation.messages,
        tools=chat_tools(request.tools, conversation.referenced_tools),
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
        response_format=_response_format(request.output_config),
        chat_template_kwargs=kwargs or None,
        thinking_token_budget=budget,
        **fields,
    )
