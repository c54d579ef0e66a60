"""chat_default_max_tokens: a chat request that names no max tokens gets `value` as its default.

Acts on: /v1/chat/completions (and /tokenize with messages) with neither `max_tokens` nor
`max_completion_tokens`. Leaves alone: requests that give either (an explicit value always wins),
completions. The default is a default, not a request: a prompt that leaves less room than `value` gets
what room is left instead of a context-length error.
"""

from __future__ import annotations

import msgspec

from deltafin.protocol.chat import ChatCompletionRequest
from deltafin.rules.base import Request, Rule, RuleContext


class ChatDefaultMaxTokens(Rule):
    def __init__(self, value: int) -> None:
        if value < 1:
            raise ValueError(f"value must be at least 1, got {value}")
        self.value = value

    def request(self, request: Request, ctx: RuleContext) -> Request:
        if not isinstance(request, ChatCompletionRequest) or request.requested_max_tokens() is not None:
            return request
        return msgspec.structs.replace(request, max_tokens_default=self.value)
