"""Typed Anthropic Messages requests (/v1/messages, /v1/messages/count_tokens).

Fields are Anthropic's (the official SDK's `MessageCreateParams` / `MessageCountTokensParams`). Unknown top-level
fields are tolerated, as for the OpenAI routes: Claude Code sends `context_management`, `output_config`,
`metadata`, and the SDK adds new ones (`service_tier`, `container`, `inference_geo`, ...) that change nothing
Deltafin does. Content blocks are a closed set: a block type Deltafin cannot read (`document`, server-tool
results, ...) is a 400 naming it, never dropped silently.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

Unit = Annotated[float, Meta(ge=0.0, le=1.0)]


class TextBlock(Struct, tag="text", tag_field="type", kw_only=True):
    text: str
    cache_control: dict[str, Any] | None = None
    citations: Any = None


class ImageBlock(Struct, tag="image", tag_field="type", kw_only=True):
    source: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolReferenceBlock(Struct, tag="tool_reference", tag_field="type", kw_only=True):
    """In a tool_result: a deferred tool (`defer_loading`) the tool search loaded (Claude Code's ToolSearch)."""

    tool_name: str


class ToolUseBlock(Struct, tag="tool_use", tag_field="type", kw_only=True):
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None
    caller: Any = None


ToolResultPart = TextBlock | ImageBlock | ToolReferenceBlock


class ToolResultBlock(Struct, tag="tool_result", tag_field="type", kw_only=True):
    tool_use_id: str
    content: str | list[ToolResultPart] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None


class ThinkingBlock(Struct, tag="thinking", tag_field="type", kw_only=True):
    thinking: str = ""
    # A signature Deltafin issued carries the reasoning (deltafin.serving.messages.signature); one it did not,
    # or none, is accepted too.
    signature: str | None = None
    cache_control: dict[str, Any] | None = None


class RedactedThinkingBlock(Struct, tag="redacted_thinking", tag_field="type", kw_only=True):
    data: str


ContentBlock = TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock


class InputMessage(Struct, kw_only=True):
    # `system` turns mid-conversation: Claude Code appends them (the SDK types them as SystemMessageParam).
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class Tool(Struct, kw_only=True):
    name: Annotated[str, Meta(min_length=1)]
    description: str | None = None
    # Required for client tools; Anthropic's own tools (`type: "web_search_20250305"`, `bash_20250124`, ...) have
    # none, and are refused by name (deltafin.serving.messages.request).
    input_schema: dict[str, Any] | None = None
    type: str | None = None
    #: hidden from the model until a tool_reference in the conversation names it (Anthropic's tool search)
    defer_loading: bool | None = None
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None
    eager_input_streaming: bool | None = None
    input_examples: Any = None
    allowed_callers: Any = None


class ToolChoice(Struct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(Struct, kw_only=True):
    type: Literal["enabled", "disabled", "adaptive"]
    # Anthropic's minimum is 1024; small local models need small budgets, so any positive value is accepted.
    budget_tokens: Annotated[int, Meta(ge=1)] | None = None
    #: "summarized" (the default: the reasoning is returned) or "omitted" (it travels only in the signature)
    display: str | None = None


class OutputFormat(Struct, kw_only=True):
    type: str
    schema: dict[str, Any] | None = None


class OutputConfig(Struct, kw_only=True):
    effort: str | None = None
    format: OutputFormat | None = None


class CountTokensRequest(Struct, kw_only=True):
    """What shapes the prompt: /v1/messages/count_tokens takes exactly this."""

    model: Annotated[str, Meta(min_length=1)]
    messages: Annotated[list[InputMessage], Meta(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    max_tokens: Annotated[int, Meta(ge=1)]
    stream: bool = False
    stop_sequences: list[str] | None = None
    temperature: Unit | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    metadata: dict[str, Any] | None = None
