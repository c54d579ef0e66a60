"""Typed /v1/responses requests (OpenAI's Responses API).

Fields Deltafin serves are typed here; `input` items and `tools` stay plain JSON and are read by
deltafin.serving.responses (their shapes are a dozen item and tool kinds, several without a `type` tag, and each
unsupported one must be a 400 naming its own path). Fields of the API that Deltafin does not serve are declared
too, so that a request using one is refused by name (`check`) instead of silently answered without it; fields
outside the API are tolerated, as chat tolerates them.
"""

from __future__ import annotations

from typing import Annotated, Any

from msgspec import Meta, Struct

from deltafin.errors import InvalidRequestError
from deltafin.protocol.common import PositiveInt, RepetitionPenalty, Temperature, Unit, UnitOpenLeft

#: `include` values: served, or about hosted-tool items that Deltafin never produces (so there is nothing to add)
INCLUDABLE = frozenset(
    {
        "reasoning.encrypted_content",
        "message.output_text.logprobs",
        "web_search_call.action.sources",
        "web_search_call.results",
        "file_search_call.results",
        "code_interpreter_call.outputs",
        "computer_call_output.output.image_url",
        "message.input_image.image_url",
    }
)
#: reasoning.effort values of the API; "none" and "minimal" ask for no reasoning
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
#: reasoning.summary values: accepted; Deltafin writes no summaries (the reasoning itself is returned)
SUMMARIES = ("auto", "concise", "detailed")
TEXT_FORMATS = ("text", "json_object", "json_schema")


class TextFormat(Struct, kw_only=True):
    """`text.format`: the flat Responses form of chat's response_format (`name`/`schema` beside `type`)."""

    type: str
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class TextConfig(Struct, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(Struct, kw_only=True):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None  # the API's older name for `summary`
    # The thinking budget where OpenRouter's unified `reasoning` object puts it (OpenAI's has none); the same as
    # the top-level `thinking_token_budget`.
    max_tokens: Annotated[int, Meta(ge=0)] | None = None


class ResponsesRequest(Struct, kw_only=True):
    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: PositiveInt | None = None
    # vLLM's name for the most reasoning tokens (as on chat and completions); `reasoning.max_tokens` says the same
    thinking_token_budget: Annotated[int, Meta(ge=0)] | None = None
    temperature: Temperature | None = None
    top_p: UnitOpenLeft | None = None
    # vLLM's extensions, as chat takes them
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    min_p: Unit | None = None
    repetition_penalty: RepetitionPenalty | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: str | None = None
    include: list[str] | None = None
    # Hints and labels that change nothing about the answer; accepted and echoed (prompt caching is automatic:
    # the prefix cache reuses any shared prefix).
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    client_metadata: dict[str, Any] | None = None
    stream_options: dict[str, Any] | None = None
    # Parts of the API Deltafin does not serve: any value but null/false is a 400 naming the field.
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: Any = None
    context_management: Any = None
    background_options: Any = None
    moderation: Any = None
    image: Any = None
    access_programs: Any = None
    prompt_cache_options: Any = None

    def check(self) -> None:
        """Checks beyond types: values the API allows that Deltafin does not serve are refused by name."""
        for name in (
            "conversation",
            "prompt",
            "max_tool_calls",
            "context_management",
            "background_options",
            "moderation",
            "image",
            "access_programs",
            "prompt_cache_options",
        ):
            if getattr(self, name) is not None:
                raise InvalidRequestError(f"`{name}` is not supported by this server", param=name)
        if self.background:
            raise InvalidRequestError(
                "background responses are not supported by this server; send "
                "`background: false` (or leave it out) and stream instead",
                param="background",
            )
        if self.truncation not in (None, "auto", "disabled"):
            raise InvalidRequestError("truncation must be 'auto' or 'disabled'", param="truncation")
        for i, value in enumerate(self.include or ()):
            if value not in INCLUDABLE:
                raise InvalidRequestError(f"include[{i}]: {value!r} is not a known includable", param=f"include[{i}]")
        if self.metadata is not None:
            if len(self.metadata) > 16:
                raise InvalidRequestError("metadata may have at most 16 keys", param="metadata")
            for key, value in self.metadata.items():
                if len(key) > 64 or len(value) > 512:
                    raise InvalidRequestError(
                        "metadata keys are at most 64 characters, values at most 512", param=f"metadata.{key[:64]}"
                    )
        reasoning = self.reasoning
        if reasoning is not None:
            given = (reasoning.max_tokens, self.thinking_token_budget)
            if None not in given and given[0] != given[1]:
                raise InvalidRequestError(
                    "reasoning.max_tokens and thinking_token_budget are the same budget; send one of them",
                    param="reasoning.max_tokens",
                )
            if reasoning.effort is not None and reasoning.effort not in EFFORTS:
                raise InvalidRequestError(
                    f"reasoning.effort must be one of {', '.join(EFFORTS)}", param="reasoning.effort"
                )
            for name in ("summary", "generate_summary"):
                value = getattr(reasoning, name)
                if value is not None and value not in SUMMARIES:
                    raise InvalidRequestError(
                        f"reasoning.{name} must be one of {', '.join(SUMMARIES)}", param=f"reasoning.{name}"
                    )
        text = self.text
        if text is not None:
            if text.verbosity not in (None, "medium"):
                raise InvalidRequestError(
                    "text.verbosity other than 'medium' is not supported by this server", param="text.verbosity"
                )
            fmt = text.format
            if fmt is not None:
                if fmt.type not in TEXT_FORMATS:
                    raise InvalidRequestError(
                        f"text.format.type must be one of {', '.join(TEXT_FORMATS)}, got {fmt.type!r}",
                        param="text.format.type",
                    )
                if fmt.type == "json_schema" and fmt.schema is None:
                    raise InvalidRequestError(
                        "text.format of type json_schema needs `schema`", param="text.format.schema"
                    )
        if self.service_tier not in (None, "auto", "default", "flex", "priority", "scale"):
            raise InvalidRequestError(
                "service_tier must be auto, default, flex, priority or scale", param="service_tier"
            )

    @property
    def budget(self) -> tuple[int | None, str]:
        """The thinking budget and the field that gave it."""
        if self.thinking_token_budget is not None:
            return self.thinking_token_budget, "thinking_token_budget"
        given = self.reasoning.max_tokens if self.reasoning is not None else None
        return given, "reasoning.max_tokens" if given is not None else "thinking_token_budget"

    @property
    def stores(self) -> bool:
        """`store` defaults to true, as in OpenAI's API."""
        return self.store is not False

    def includes(self, value: str) -> bool:
        return value in (self.include or ())


class InputItemsQuery(Struct, kw_only=True):
    """GET /v1/responses/{id}/input_items: cursor pagination as OpenAI's list endpoints do it."""

    limit: Annotated[int, Meta(ge=1, le=100)] = 20
    order: str = "desc"
    after: str | None = None
