"""kimi_thinking: Kimi's request field `thinking: {"type": ...}` becomes the template kwarg `thinking`.

Acts on: chat requests with a `thinking` object: `chat_template_kwargs.thinking` is set to
`type != "disabled"`. Leaves alone: requests without `thinking`, and requests whose own
`chat_template_kwargs` already set `thinking` (the explicit template kwarg wins).
"""

from __future__ import annotations

import msgspec

from deltafin.errors import InvalidRequestError
from deltafin.protocol.chat import ChatCompletionRequest
from deltafin.rules.base import Request, Rule, RuleContext


class KimiThinking(Rule):
    def __init__(self, kwarg: str = "thinking") -> None:
        self.kwarg = kwarg

    def request(self, request: Request, ctx: RuleContext) -> Request:
        if not isinstance(request, ChatCompletionRequest) or request.thinking is None:
            return request
        kind = request.thinking.get("type")
        if not isinstance(kind, str):
            raise InvalidRequestError('thinking must be {"type": "enabled"} or {"type": "disabled"}', param="thinking")
        kwargs = dict(request.chat_template_kwargs or {})
        if self.kwarg in kwargs:
            return request
        kwargs[self.kwarg] = kind != "disabled"
        return msgspec.structs.replace(request, chat_template_kwargs=kwargs)
