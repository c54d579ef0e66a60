"""flatten_tool_text: a tool message whose content is a list of only text parts becomes one string.

The parts are joined with no separator (some templates, GLM's among them, print list content part by part
and leak the dicts into the prompt). Acts on: role=tool messages with list content made only of text parts.
Leaves alone: string content, other roles, and lists holding any non-text part.
"""

from __future__ import annotations

import msgspec

from deltafin.protocol.chat import ChatCompletionRequest, ChatMessage, TextPart
from deltafin.rules.base import Request, Rule, RuleContext


def _flatten(message: ChatMessage) -> ChatMessage:
    content = message.content
    if message.role != "tool" or not isinstance(content, list) or not content:
        return message
    if not all(isinstance(part, TextPart) for part in content):
        return message
    return msgspec.structs.replace(
        message, content="".join(part.text for part in content if isinstance(part, TextPart))
    )


class FlattenToolText(Rule):
    def request(self, request: Request, ctx: RuleContext) -> Request:
        if not isinstance(request, ChatCompletionRequest):
            return request
        messages = [_flatten(m) for m in request.messages]
        if all(new is old for new, old in zip(messages, request.messages)):
            return request
        return msgspec.structs.replace(request, messages=messages)
