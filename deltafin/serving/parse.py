"""/parse: the assistant message the served model's parsers make of raw model output.

The debugging tool for "the tool call didn't parse": paste the raw text (special tokens included) and see
content, reasoning_content and tool_calls exactly as chat would return them. The prompt the text continues is
rendered by the model's own chat format (with `thinking` on or off), so it starts where a real answer would.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from deltafin.engine import Finished
from deltafin.markup import OutputParser, ParsedDelta, ToolCallDelta
from deltafin.protocol.chat import ChatCompletionRequest, ChatMessage
from deltafin.protocol.parse import ParseRequest
from deltafin.serving.chat import ChatService, ChoiceAssembly
from deltafin.serving.chat_constraint import ToolUse

#: /parse feeds the text to the parser in pieces of this many characters, as a stream arrives: a parser scans
#: and copies what follows a marker, so a whole text fed at once was scanned again from each of its markers
#: (40,000 GLM calls, 2.8 MB: 30 s and more); a piece at a time, each marker costs at most a piece
PIECE_CHARS = 1024


def feed_in_pieces(parser: OutputParser, text: str, finish_reason: str) -> ParsedDelta:
    """What `parser` makes of `text` fed a piece at a time, then finished, as one delta: content, reasoning and
    each call's arguments gathered in pieces and joined once (the same as fed whole: parsers read a stream,
    which the markup tests check at every split)."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, tuple[ToolCallDelta, list[str]]] = {}
    pieces = [text[start : start + PIECE_CHARS] for start in range(0, len(text), PIECE_CHARS)]
    for parsed in [*(parser.feed(piece) for piece in pieces), parser.finish(finish_reason)]:
        content.append(parsed.content)
        reasoning.append(parsed.reasoning)
        for delta in parsed.tool_calls:
            if delta.index not in calls:
                calls[delta.index] = (ToolCallDelta(delta.index, delta.id, delta.name), [])
            calls[delta.index][1].append(delta.arguments)
    return ParsedDelta(
        content="".join(content),
        reasoning="".join(reasoning),
        tool_calls=[replace(head, arguments="".join(arguments)) for head, arguments in calls.values()],
    )


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
        choice.add(feed_in_pieces(choice.parser, request.text, request.finish_reason))
        choice.finished = Finished(0, request.finish_reason, 0, 0)
        return {"message": choice.message(), "finish_reason": choice.finish_reason}
