"""/tokenize and /detokenize: the exact token ids a prompt or a chat request becomes, and back."""

from __future__ import annotations

from typing import Any

from deltafin.errors import InvalidRequestError
from deltafin.protocol.chat import ChatCompletionRequest
from deltafin.protocol.tokenize import DetokenizeRequest, TokenizeRequest
from deltafin.serving.chat import ChatService
from deltafin.serving.context import RequestStats, ServingContext


class TokenizeService:
    def __init__(self, ctx: ServingContext, chat: ChatService) -> None:
        self.ctx = ctx
        self.chat = chat

    def as_chat_request(self, request: TokenizeRequest) -> ChatCompletionRequest:
        if request.messages is None:
            raise InvalidRequestError("give either `prompt` or `messages`", param="prompt")
        if not request.messages:
            raise InvalidRequestError("messages must not be empty", param="messages")
        chat_request = ChatCompletionRequest(
            messages=request.messages,
            tools=request.tools,
            tool_choice=request.tool_choice,
            response_format=request.response_format,
            reasoning_effort=request.reasoning_effort,
            chat_template_kwargs=request.chat_template_kwargs,
            thinking=request.thinking,
        )
        chat_request.check_request_shape()  # the checks chat makes of these fields, so both answer alike
        return chat_request

    def tokenize(self, request: TokenizeRequest, stats: RequestStats) -> dict[str, Any]:
        """With `messages`, the chat request rules run first, so the prompt is exactly the one chat would see."""
        self.ctx.check_model(request.model)
        if request.prompt is not None and request.messages is not None:
            raise InvalidRequestError("give either `prompt` or `messages`, not both", param="prompt")
        if request.prompt is not None:
            tokenizer = self.ctx.tokenizer
            ids = list(tokenizer(request.prompt, add_special_tokens=request.add_special_tokens).input_ids)
        else:
            as_chat = self.as_chat_request(request)
            chat_request = self.ctx.rules.on_request(as_chat, self.chat.rule_context(as_chat, "tokenize"), stats.rules)
            assert isinstance(chat_request, ChatCompletionRequest)  # rules keep a request's type
            ids = self.chat.render(chat_request, add_generation_prompt=request.add_generation_prompt).token_ids
        body: dict[str, Any] = {"tokens": ids, "count": len(ids), "max_model_len": self.ctx.engine.context_length}
        if request.return_token_strs:
            body["token_strs"] = self.ctx.tokenizer.convert_ids_to_tokens(ids)
        return body

    def detokenize(self, request: DetokenizeRequest) -> dict[str, Any]:
        self.ctx.check_model(request.model)
        vocab = len(self.ctx.tokenizer)
        for i, token in enumerate(request.tokens):
            if token >= vocab:
                raise InvalidRequestError(
                    f"token {token} is outside the vocabulary (size {vocab})", param=f"tokens[{i}]"
                )
        return {"prompt": self.ctx.tokenizer.decode(request.tokens, skip_special_tokens=False)}
