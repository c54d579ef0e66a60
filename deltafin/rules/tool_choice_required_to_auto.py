"""tool_choice_required_to_auto: tool_choice "required" is served as "auto".

Acts on: chat requests with tool_choice "required". Leaves alone: every other tool_choice. Para scopes it to
the glm family, whose templates have no way to force a call.
"""

from __future__ import annotations

import msgspec

from deltafin.protocol.chat import ChatCompletionRequest
from deltafin.rules.base import Request, Rule, RuleContext


class ToolChoiceRequiredToAuto(Rule):
    def request(self, request: Request, ctx: RuleContext) -> Request:
        if not isinstance(request, ChatCompletionRequest) or request.tool_choice != "required":
            return request
        return msgspec.structs.replace(request, tool_choice="auto")
