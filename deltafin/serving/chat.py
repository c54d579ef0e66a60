"""/v1/chat/completions: rules, render, check the context, generate, assemble JSON or SSE chunks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from deltafin.engine import Finished, GenerationJob, TextDelta, TokenLogprob
from deltafin.engine.engine import GenerationStream
from deltafin.prompt.chat_format import RenderedPrompt
from deltafin.prompt.parsers import OutputParser, ParsedDelta, build_output_parser
from deltafin.protocol.chat import ChatCompletionRequest
from deltafin.rules import RuleContext
from deltafin.serving.context import RequestStats, ServingContext, new_id
from deltafin.serving.logprobs import chat_logprobs
from deltafin.serving.ruled import serve_with_rules
from deltafin.serving.sse import ChunkStream, StreamingResponse


@dataclass
class _Choice:
    parser: OutputParser
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: Finished | None = None

    def add(self, parsed: ParsedDelta) -> ParsedDelta:
        self.content.append(parsed.content)
        self.reasoning.append(parsed.reasoning)
        return parsed


class ChatService:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    def rule_context(self, request: ChatCompletionRequest, endpoint: str = "chat") -> RuleContext:
        return RuleContext(
            family=self.ctx.config.model.family,
            endpoint=endpoint,
            context_length=self.ctx.engine.context_length,
            stream=request.stream,
            include_usage=request.include_usage,
        )

    def render(self, request: ChatCompletionRequest, *, add_generation_prompt: bool = True) -> RenderedPrompt:
        return self.ctx.chat_format.render(
            request.messages,
            request.tools,
            dict(request.chat_template_kwargs or {}),
            add_generation_prompt=add_generation_prompt,
        )

    def jobs(self, request: ChatCompletionRequest, prompt: RenderedPrompt) -> list[GenerationJob]:
        limits = self.ctx.config.server
        request.check(max_n=limits.max_n, max_stop=limits.max_stop_sequences, max_top_logprobs=limits.max_top_logprobs)
        requested = request.requested_max_tokens()
        param = "max_completion_tokens" if request.max_completion_tokens is not None else "messages"
        room = self.ctx.check_context(len(prompt.token_ids), requested, param)
        if requested is not None:
            max_tokens = requested
        elif request.max_tokens_default is not None:
            max_tokens = min(request.max_tokens_default, room)
        else:
            max_tokens = room  # omitted: run to EOS, bounded only by the context
        ids = tuple(prompt.token_ids)
        return [
            GenerationJob(
                ids,
                request.sampling_params(
                    max_tokens=max_tokens,
                    vocab_size=self.ctx.engine.vocab_size,
                    logprobs=request.logprobs,
                    top_logprobs=request.top_logprobs or 0,
                    choice=i,
                ),
            )
            for i in range(request.n)
        ]

    async def create(self, request: ChatCompletionRequest, stats: RequestStats) -> dict[str, Any] | StreamingResponse:
        rule_ctx = self.rule_context(request)

        async def produce(request: ChatCompletionRequest) -> dict[str, Any] | ChunkStream:
            self.ctx.check_model(request.model)
            prompt = self.render(request)
            jobs = self.jobs(request, prompt)
            stats.prompt_tokens = len(prompt.token_ids)
            stream = await self.ctx.engine.start(jobs)
            stats.queue_wait_s = stream.queue_wait
            choices = [_Choice(build_output_parser(self.ctx.config.model.tool_parser)) for _ in jobs]
            if request.stream:
                return ChunkStream(self._chunks(request, stream, choices, stats, rule_ctx), stream.close)
            return await self._collect(request, stream, choices, stats, rule_ctx)

        return await serve_with_rules(self.ctx, request, rule_ctx, stats, produce)

    def _finish(self, choice: _Choice, event: Finished, stats: RequestStats, rule_ctx: RuleContext) -> ParsedDelta:
        parsed = choice.add(choice.parser.finish())
        choice.finished = event
        stats.record(event)
        reasoning = "".join(choice.reasoning)
        if reasoning:  # reasoning tokens are part of completion_tokens; rules may report them separately
            rule_ctx.reasoning_tokens += self.ctx.engine.count_tokens(reasoning)
        return parsed

    async def _collect(
        self,
        request: ChatCompletionRequest,
        stream: GenerationStream,
        choices: list[_Choice],
        stats: RequestStats,
        rule_ctx: RuleContext,
    ) -> dict[str, Any]:
        async for event in stream:
            choice = choices[event.choice]
            if isinstance(event, TextDelta):
                if event.text:
                    stats.first_token()
                    choice.add(choice.parser.feed(event.text))
                choice.logprobs.extend(event.logprobs)
            else:
                self._finish(choice, event, stats, rule_ctx)
        body_choices = []
        for index, choice in enumerate(choices):
            assert choice.finished is not None
            message: dict[str, Any] = {"role": "assistant", "content": "".join(choice.content)}
            reasoning = "".join(choice.reasoning)
            if reasoning:
                message["reasoning_content"] = reasoning
            logprobs = {"content": chat_logprobs(choice.logprobs, self.ctx.token_text)} if request.logprobs else None
            body_choices.append(
                {"index": index, "message": message, "logprobs": logprobs, "finish_reason": choice.finished.reason}
            )
        return {
            **self._envelope("chat.completion"),
            "choices": body_choices,
            "usage": self.ctx.usage(stats.prompt_tokens, stats.completion_tokens, stats.cached_tokens),
        }

    def _envelope(self, kind: str) -> dict[str, Any]:
        return {
            "id": new_id("chatcmpl"),
            "object": kind,
            "created": self.ctx.created_now(),
            "model": self.ctx.model_name,
            "system_fingerprint": self.ctx.fingerprint,
        }

    async def _chunks(
        self,
        request: ChatCompletionRequest,
        stream: GenerationStream,
        choices: list[_Choice],
        stats: RequestStats,
        rule_ctx: RuleContext,
    ) -> AsyncIterator[dict[str, Any]]:
        base = self._envelope("chat.completion.chunk")
        include_usage = request.include_usage

        def chunk(index: int, delta: dict[str, Any], *, finish: str | None = None, logprobs: Any = None) -> dict:
            body = {**base, "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
            if include_usage:
                body["usage"] = None
            return body

        def delta_chunk(index: int, parsed: ParsedDelta) -> dict:
            delta: dict[str, Any] = {}
            if parsed.reasoning:
                delta["reasoning_content"] = parsed.reasoning
            if parsed.content:
                delta["content"] = parsed.content
            logprobs = None
            if request.logprobs:
                logprobs = {"content": chat_logprobs(pending.pop(index, []), self.ctx.token_text)}
            return chunk(index, delta, logprobs=logprobs)

        started: set[int] = set()
        pending: dict[int, list[TokenLogprob]] = {}
        async for event in stream:
            index = event.choice
            if index not in started:
                started.add(index)
                yield chunk(index, {"role": "assistant", "content": ""})
            if isinstance(event, TextDelta):
                pending.setdefault(index, []).extend(event.logprobs)
                if not event.text:
                    continue
                stats.first_token()
                parsed = choices[index].add(choices[index].parser.feed(event.text))
                if parsed:
                    yield delta_chunk(index, parsed)
            else:
                parsed = self._finish(choices[index], event, stats, rule_ctx)
                if parsed:
                    yield delta_chunk(index, parsed)
                yield chunk(index, {}, finish=event.reason)
        if include_usage:
            usage = self.ctx.usage(stats.prompt_tokens, stats.completion_tokens, stats.cached_tokens)
            yield {**base, "choices": [], "usage": usage}
