"""max_tokens_cap: bounds the completion tokens of every chat and completion request (0 = off).

Acts on: an explicit max tokens above `value` (lowered to `value`), and requests without one (their default,
run-to-EOS for chat or 256 for completions, is bounded by `value`). Leaves alone: explicit values at or below
the cap, and everything when `value` is 0.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from deltafin.protocol.chat import ChatCompletionRequest
from deltafin.rules.base import Request, Rule, RuleContext


class MaxTokensCap(Rule):
    def __init__(self, value: Annotated[int, Meta(ge=0)]) -> None:
        if value < 0:
            raise ValueError(f"value must be 0 (off) or positive, got {value}")
        self.value = value

    def request(self, request: Request, ctx: RuleContext) -> Request:
        if self.value == 0:
            return request
        if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
            if request.max_completion_tokens <= self.value:
                return request
            return msgspec.structs.replace(request, max_completion_tokens=self.value)
        if request.max_tokens is None or request.max_tokens <= self.value:
            return request
        return msgspec.structs.replace(request, max_tokens=self.value)

    def default_max_tokens(self, default: int | None, request: Request, ctx: RuleContext) -> int | None:
        if self.value == 0 or (default is not None and default <= self.value):
            return default
        return self.value
