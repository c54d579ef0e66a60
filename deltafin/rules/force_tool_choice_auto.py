"""force_tool_choice_auto: an explicit `tool_choice` other than "auto" is served as "auto".

Acts on: chat requests whose tool_choice is "none", "required" or a named function. Leaves alone: requests
without tool_choice and those that already say "auto".
"""

from __future__ import annotations

import msgspec

from deltafin.protocol.chat import ChatCompletionRequest
from deltafin.rules.base import Request, Rule, RuleContext


class ForceToolChoiceAuto(Rule):
    def request(self, request: Request, ctx: RuleContext) -> Request:
        if not isinstance(request, ChatCompletionRequest) or request.tool_choice in (None, "auto"):
            return request
        return msgspec.structs.replace(request, tool_choice="auto")
