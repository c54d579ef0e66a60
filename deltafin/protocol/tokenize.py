"""Typed /tokenize and /detokenize requests."""

from __future__ import annotations

from typing import Annotated, Any

from msgspec import Meta, Struct

from deltafin.protocol.chat import ChatMessage, ResponseFormat, ToolDefinition


class TokenizeRequest(Struct, kw_only=True):
    """Either a raw `prompt` or chat `messages` rendered exactly as /v1/chat/completions renders them."""

    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDefinition] | None = None
    # Everything else that shapes a chat render, as /v1/chat/completions takes it:
    tool_choice: str | dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None  # Kimi's request field, as chat takes it (see kimi_thinking)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    model: str | None = None


class DetokenizeRequest(Struct, kw_only=True):
    tokens: list[Annotated[int, Meta(ge=0)]]
    model: str | None = None
