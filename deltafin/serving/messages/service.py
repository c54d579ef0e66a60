"""/v1/messages and /v1/messages/count_tokens (Anthropic's Messages API) on top of the chat path.

A Messages request becomes a chat request (.request, .conversation) that ChatService serves itself, rules
included; its answer, a chat body or chat chunks, is reshaped into a Message or the Messages event stream
(.output). count_tokens renders the same chat request the same way and counts its tokens, so its number is the
prompt /v1/messages generates from. A prompt that fills the context is answered with the 400 text Claude Code
reads (`prompt is too long: N tokens > M maximum`: it then compacts the conversation); a `max_tokens` larger than
what the prompt leaves is cut to it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from deltafin.errors import DeltafinError, InvalidRequestError
from deltafin.protocol.chat import ChatCompletionRequest, ChatMessage
from deltafin.protocol.messages import CountTokensRequest, MessagesRequest
from deltafin.serving.chat import ChatService
from deltafin.serving.context import RequestStats, ServingContext
from deltafin.serving.messages.output import MessageEvents, MessageShape, error_event, sse
from deltafin.serving.messages.request import chat_request
from deltafin.serving.sse import StreamingResponse

_PROBE = ("deltafin-probe-before", "deltafin-probe-system", "deltafin-probe-after")


class MessagesService:
    def __init__(self, ctx: ServingContext, chat: ChatService) -> None:
        self.ctx = ctx
        self.chat = chat
        self._inline_system: bool | None = None

    def inline_system(self) -> bool:
        """Whether the chat format renders a system turn mid-conversation where it stands (asked once, of the
        format itself: a template may refuse one, drop it or move it to the head)."""
        if self._inline_system is None:
            before, system, after = _PROBE
            probe = [
                ChatMessage(role="user", content=before),
                ChatMessage(role="system", content=system),
                ChatMessage(role="user", content=after),
            ]
            try:
                text = self.ctx.chat_format.render(probe, None, {}).text
                self._inline_system = -1 < text.find(before) < text.find(system) < text.find(after)
            except DeltafinError:
                self._inline_system = False
        return self._inline_system

    def chat_request(self, request: CountTokensRequest) -> ChatCompletionRequest:
        return chat_request(
            request, thinking_kwarg=self.ctx.config.model.thinking_kwarg, inline_system=self.inline_system()
        )

    async def create(self, request: MessagesRequest, stats: RequestStats) -> dict[str, Any] | StreamingResponse:
        served = self.chat_request(request)
        rule_ctx = self.chat.rule_context(served)
        omitted = request.thinking is not None and request.thinking.display == "omitted"
        shape = MessageShape(request.model, omit_thinking=omitted, stop_sequences=request.stop_sequences)
        try:
            if request.stream:
                frame = _framer(shape, stats)
                return await self.chat.create(served, stats, frame=frame, rule_ctx=rule_ctx, fit_max_tokens=True)
            completion = await self.chat.create(served, stats, rule_ctx=rule_ctx, fit_max_tokens=True)
        except DeltafinError as err:
            raise self._in_anthropic_words(err, stats) from None
        assert isinstance(completion, dict)
        return shape.from_chat(completion)

    async def count_tokens(self, request: CountTokensRequest, stats: RequestStats) -> dict[str, Any]:
        self.ctx.check_model(request.model)
        served = self.chat_request(request)
        ruled = self.ctx.rules.on_request(served, self.chat.rule_context(served, "tokenize"), stats.rules)
        assert isinstance(ruled, ChatCompletionRequest)  # rules keep a request's type
        prompt = await self.ctx.off_loop(self.chat.render, ruled, size=stats.body_bytes, stats=stats)
        stats.prompt_tokens = len(prompt.token_ids)
        return {"input_tokens": len(prompt.token_ids)}

    def _in_anthropic_words(self, err: DeltafinError, stats: RequestStats) -> DeltafinError:
        """A prompt over the context (a 400, or a rule's 413) as the 400 Anthropic answers and Claude Code parses
        to compact its conversation."""
        if err.code != "context_length_exceeded":
            return err
        limit = self.ctx.engine.context_length
        return InvalidRequestError(
            f"prompt is too long: {stats.prompt_tokens} tokens > {limit - 1} maximum",
            param="messages",
            code="context_length_exceeded",
        )


def _framer(shape: MessageShape, stats: RequestStats) -> Any:
    def frame(
        chunks: AsyncIterator[dict], map_error: Callable[[DeltafinError], DeltafinError], close: Callable[[], None]
    ) -> AsyncIterator[bytes]:
        events = MessageEvents(shape, stats.prompt_tokens)

        async def body() -> AsyncIterator[bytes]:
            held = b""  # message_start leaves with the ping that follows it: one write
            try:
                async for event in events.events(chunks):
                    if event["type"] == "message_start":
                        held = sse(event)
                        continue
                    yield held + sse(event)
                    held = b""
            except DeltafinError as exc:
                yield held + sse(error_event(map_error(exc)))
            finally:
                close()

        return body()

    return frame
