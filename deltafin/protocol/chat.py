"""Typed /v1/chat/completions requests (unknown fields are tolerated, as OpenAI clients send extras)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from deltafin.errors import InvalidRequestError
from deltafin.protocol.common import PositiveInt, SamplingFields

Role = Literal["system", "developer", "user", "assistant", "tool"]


class TextPart(Struct, tag="text", tag_field="type"):
    text: str


class ImageURL(Struct):
    url: str
    detail: str | None = None


class ImagePart(Struct, tag="image_url", tag_field="type"):
    # A bare string is accepted as {"url": ...}; serving normalizes it.
    image_url: str | ImageURL


ContentPart = TextPart | ImagePart


class FunctionCall(Struct):
    name: str
    # History may carry arguments as a JSON string (OpenAI) or an already-decoded object.
    arguments: str | dict[str, Any] = ""


class ToolCall(Struct, kw_only=True):
    function: FunctionCall
    id: str | None = None
    type: Literal["function"] = "function"


class FunctionDefinition(Struct, kw_only=True):
    name: Annotated[str, Meta(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(Struct, kw_only=True):
    function: FunctionDefinition
    type: Literal["function"] = "function"


class ChatMessage(Struct, kw_only=True, omit_defaults=True):
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # the same, under the name newer vLLM returns (clients send it back)
    # Tools declared mid-conversation by a system message (Kimi K3 renders them as "New Tools Available").
    tools: list[ToolDefinition] | None = None


class JsonSchemaFormat(Struct, kw_only=True):
    name: str | None = None
    description: str | None = None
    # `schema` is the OpenAI field name; msgspec maps it as is.
    schema: dict[str, Any] | None = None
    # Deltafin enforces the schema whether strict is true or not (not enforcing is never better for a client).
    strict: bool | None = None


class ResponseFormat(Struct, kw_only=True):
    """`{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}`; the type is checked in `check`
    so that an unknown one is a 400 naming `response_format.type`."""

    type: str
    json_schema: JsonSchemaFormat | None = None


RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0)] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Kimi's request field ({"type": "enabled" | "disabled"}), mapped by a compat rule.
    thinking: dict[str, Any] | None = None
    reasoning_effort: str | None = None

    def requested_max_tokens(self) -> int | None:
        """`max_completion_tokens` wins over the legacy `max_tokens` when both are given."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def check(self, *, max_n: int, max_stop: int, max_top_logprobs: int) -> None:
        """Checks that need more than one field or a server limit (types were checked on decode)."""
        if self.n > max_n:
            raise InvalidRequestError(f"n must be at most {max_n}", param="n")
        if len(self.stop_list()) > max_stop:
            raise InvalidRequestError(f"at most {max_stop} stop sequences are allowed", param="stop")
        if self.top_logprobs is not None:
            if self.top_logprobs > max_top_logprobs:
                raise InvalidRequestError(f"top_logprobs must be at most {max_top_logprobs}", param="top_logprobs")
            if self.top_logprobs > 0 and not self.logprobs:
                raise InvalidRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
        self.check_request_shape()

    def check_request_shape(self) -> None:
        """The checks of what shapes the prompt (messages, tool_choice, response_format), shared with /tokenize."""
        for i, message in enumerate(self.messages):
            if message.role == "tool" and message.content is None:
                raise InvalidRequestError("a tool message needs content", param=f"messages[{i}].content")
            # A system message that declares tools (Kimi K3's mid-conversation declaration) may have no text.
            if message.role in ("system", "developer", "user") and message.content is None and not message.tools:
                raise InvalidRequestError(f"a {message.role} message needs content", param=f"messages[{i}].content")
        self.check_response_format()
        if isinstance(self.tool_choice, str) and self.tool_choice not in ("none", "auto", "required"):
            raise InvalidRequestError(
                "tool_choice must be 'none', 'auto', 'required' or a function object", param="tool_choice"
            )

    def check_response_format(self) -> None:
        rf = self.response_format
        if rf is None:
            return
        if rf.type not in RESPONSE_FORMAT_TYPES:
            raise InvalidRequestError(
                f"response_format.type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}, got {rf.type!r}",
                param="response_format.type",
            )
        if rf.type == "json_schema" and (rf.json_schema is None or rf.json_schema.schema is None):
            raise InvalidRequestError(
                "response_format of type json_schema needs json_schema.schema", param="response_format.json_schema"
            )
