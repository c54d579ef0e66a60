"""chat_default_max_tokens: a chat request that names no max tokens gets `value` as its default.

Acts on: chat requests (and what is served as one: /v1/responses without `max_output_tokens`) with neither
`max_tokens` nor `max_completion_tokens`. Leaves alone: requests that give either (an explicit value always
wins; serving asks this hook only for requests that name none), completions. The default is a default, not a
request: a prompt that leaves less room than `value` gets what room is left instead of a context-length error.
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from deltafin.protocol.chat import ChatCompletionRequest
from deltafin.rules.base import Request, Rule, RuleContext


class ChatDefaultMaxTokens(Rule):
    def __init__(self, value: Annotated[int, Meta(ge=1)]) -> None:
        if value < 1:
            raise ValueError(f"value must be at least 1, got {value}")
        self.value = value

    def default_max_tokens(self, default: int | None, request: Request, ctx: RuleContext) -> int | None:
        if not isinstance(request, ChatCompletionRequest):
            return default
        return self.value
