"""/v1/completions: raw prompt in, text out (echo, logprobs), JSON or SSE."""

from __future__ import annotations

import dataclasses

from typing import Any, AsyncIterator

from deltafin.engine import Finished, GenerationJob, GenerationStream, PromptLogprobs, TextDelta, TokenLogprob
from deltafin.errors import InvalidRequestError
from deltafin.protocol.completions import CompletionRequest
from deltafin.serving.context import RequestStats, ServingContext, new_id
from deltafin.serving.logprobs import completion_logprobs
from deltafin.rules import RuleContext
from deltafin.serving.ruled import serve_with_rules
from deltafin.serving.sse import ChunkStream, StreamingResponse


class CompletionService:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    def jobs(self, request: CompletionRequest, prompt_ids: list[int]) -> list[GenerationJob]:
        limits = self.ctx.config.server
        request.check(max_n=limits.max_n, max_stop=limits.max_stop_sequences, max_top_logprobs=limits.max_top_logprobs)
        if not prompt_ids:  # the protocol refuses "", this is for a tokenizer that yields nothing for a text
            raise InvalidRequestError("the prompt is empty", param="prompt")
        room = self.ctx.check_context(len(prompt_ids), request.max_tokens, "prompt")
        if request.max_tokens is not None:
            max_tokens = request.max_tokens  # an explicit value is always honoured
        else:
            # The seed's default for raw completions (256), or a rule's, bounded by the room left.
            default = request.max_tokens_default or limits.completion_default_max_tokens
            max_tokens = min(default, room)
        ids = tuple(prompt_ids)
        # echo + logprobs reports the prompt's tokens too, as OpenAI does.
        prompt_logprobs = request.logprobs if request.echo else None
        return [
            GenerationJob(
                ids,
                dataclasses.replace(
                    request.sampling_params(
                        max_tokens=max_tokens,
                        vocab_size=self.ctx.engine.vocab_size,
                        logprobs=request.logprobs is not None,
                        top_logprobs=request.logprobs or 0,
                        choice=i,
                    ),
                    prompt_logprobs=prompt_logprobs,
                ),
            )
            for i in range(request.n)
        ]

    async def create(self, request: CompletionRequest, stats: RequestStats) -> dict[str, Any] | StreamingResponse:
        rule_ctx = RuleContext(
            family=self.ctx.config.model.family,
            endpoint="completions",
            context_length=self.ctx.engine.context_length,
            stream=request.stream,
            include_usage=request.include_usage,
        )

        async def produce(request: CompletionRequest) -> dict[str, Any] | ChunkStream:
            self.ctx.check_model(request.model)
            # A raw prompt is the client's whole input: special tokens in it are meant as such.
            prompt_ids = await self.ctx.off_loop(
                lambda: list(self.ctx.tokenizer(request.prompt).input_ids), size=stats.body_bytes, stats=stats
            )
            jobs = self.jobs(request, prompt_ids)
            stats.prompt_tokens = len(prompt_ids)
            stream = await self.ctx.engine.start(jobs, deadline=self.ctx.deadline(stats))
            stats.queue_wait_s = stream.queue_wait
            if request.stream:
                return ChunkStream(self._chunks(request, stream, stats), stream.close)
            return await self._collect(request, stream, stats)

        return await serve_with_rules(self.ctx, request, rule_ctx, stats, produce)

    def _base(self) -> dict[str, Any]:
        return {"id": new_id("cmpl"), "object": "text_completion", "created": self.ctx.created_now(), "model": self.ctx.model_name}

    async def _collect(self, request: CompletionRequest, stream: GenerationStream, stats: RequestStats) -> dict[str, Any]:
        n = request.n
        texts: list[list[str]] = [[] for _ in range(n)]
        logprobs: list[list[TokenLogprob]] = [[] for _ in range(n)]
        finished: list[Finished | None] = [None] * n
        prompts: list[PromptLogprobs | None] = [None] * n
        async for event in stream:
            if isinstance(event, TextDelta):
                stats.saw(event)
                if event.text:
                    stats.first_token()
                texts[event.choice].append(event.text)
                logprobs[event.choice].extend(event.logprobs)
            elif isinstance(event, PromptLogprobs):
                prompts[event.choice] = event
            else:
                finished[event.choice] = event
                stats.record(event)
        prefix = request.prompt if request.echo else ""
        choices = []
        for index in range(n):
            end = finished[index]
            assert end is not None
            choices.append(
                {
                    "index": index,
                    "text": prefix + "".join(texts[index]),
                    "logprobs": completion_logprobs(logprobs[index], self.ctx.token_text, len(prefix), prompts[index])
                    if request.logprobs is not None
                    else None,
                    "finish_reason": end.reason,
                }
            )
        usage = self.ctx.usage(stats.prompt_tokens, stats.completion_tokens, stats.cached_tokens)
        return {**self._base(), "choices": choices, "usage": usage}

    async def _chunks(
        self, request: CompletionRequest, stream: GenerationStream, stats: RequestStats
    ) -> AsyncIterator[dict[str, Any]]:
        base = self._base()
        include_usage = request.include_usage
        offsets: dict[int, int] = {}

        def chunk(index: int, text: str, *, finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
            body = {**base, "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}
            if include_usage:
                body["usage"] = None
            return body

        pending: dict[int, list[TokenLogprob]] = {}
        async for event in stream:
            index = event.choice
            if index not in offsets:
                offsets[index] = 0
                if request.echo:
                    offsets[index] = len(request.prompt)
                    prompt_lp = None
                    if isinstance(event, PromptLogprobs):
                        prompt_lp = completion_logprobs((), self.ctx.token_text, 0, event)
                    yield chunk(index, request.prompt, logprobs=prompt_lp)
            if isinstance(event, PromptLogprobs):
                continue
            if isinstance(event, TextDelta):
                stats.saw(event)
                pending.setdefault(index, []).extend(event.logprobs)
                if not event.text:
                    continue
                stats.first_token()
                lp = None
                if request.logprobs is not None:
                    lp = completion_logprobs(pending.pop(index, []), self.ctx.token_text, offsets[index])
                offsets[index] += len(event.text)
                yield chunk(index, event.text, logprobs=lp)
            else:
                stats.record(event)
                yield chunk(index, "", finish=event.reason)
        if include_usage:
            usage = self.ctx.usage(stats.prompt_tokens, stats.completion_tokens, stats.cached_tokens)
            yield {**base, "choices": [], "usage": usage}
