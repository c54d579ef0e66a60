"""Typed /tokenize and /detokenize requests."""

from __future__ import annotations

from typing import Annotated, Any, Optional, Union

from msgspec import Meta, Struct

from deltafin.protocol.chat import ChatMessage, ResponseFormat, ToolDefinition


class TokenizeRequest(Struct, kw_only=True):
    """Either a raw `prompt` or chat `messages` rendered exactly as /v1/chat/completions renders them."""

    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    tools: Optional[list[ToolDefinition]] = None
    # Everything else that shapes a chat render, as /v1/chat/completions takes it:
    tool_choice: Union[str, dict[str, Any], None] = None
    response_format: Optional[ResponseFormat] = None
    reasoning_effort: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    thinking: Optional[dict[str, Any]] = None  # Kimi's request field, as chat takes it (see kimi_thinking)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    model: Optional[str] = None


class DetokenizeRequest(Struct, kw_only=True):
    tokens: list[Annotated[int, Meta(ge=0)]]
    model: Optional[str] = None
