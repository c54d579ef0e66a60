"""/parse: the assistant message the served model's parsers make of raw model output.

The debugging tool for "the tool call didn't parse": paste the raw text (special tokens included) and see
content, reasoning_content and tool_calls exactly as chat would return them. The prompt the text continues is
rendered by the model's own chat format (with `thinking` on or off), so it starts where a real answer would.
"""

from __future__ import annotations

from typing import Any

from deltafin.engine import Finished
from deltafin.protocol.chat import ChatCompletionRequest, ChatMessage
from deltafin.protocol.parse import ParseRequest
from deltafin.serving.chat import ChatService, ChoiceAssembly
from deltafin.serving.constraints import ToolUse


class ParseService:
    def __init__(self, chat: ChatService) -> None:
        self.chat = chat
        self.ctx = chat.ctx

    def parse(self, request: ParseRequest) -> dict[str, Any]:
        self.ctx.check_model(request.model)
        kwargs: dict[str, Any] = {}
        thinking_key = self.ctx.config.model.thinking_kwarg
        if request.thinking is not None and thinking_key:
            kwargs[thinking_key] = request.thinking
        probe = ChatCompletionRequest(
            messages=[ChatMessage(role="user", content="x")], tools=request.tools, chat_template_kwargs=kwargs
        )
        prompt = self.chat.render(probe)
        # Calls are read whenever tools are given (the text is the model's own output: nothing is forced here).
        choice = ChoiceAssembly(self.chat.output_parser(probe, prompt.text, ToolUse(calls_allowed=bool(request.tools))))
        choice.add(choice.parser.feed(request.text))
        choice.add(choice.parser.finish(request.finish_reason))
        choice.finished = Finished(0, request.finish_reason, 0, 0)
        return {"message": choice.message(), "finish_reason": choice.finish_reason}
