"""/v1/completions: raw prompt in, text out (echo, logprobs), JSON or SSE."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from deltafin.engine import Finished, GenerationJob, GenerationStream, PromptLogprobs, TextDelta, TokenLogprob
from deltafin.errors import InvalidRequestError
from deltafin.protocol.completions import CompletionRequest
from deltafin.rules import RuleContext
from deltafin.serving.context import RequestStats, ServingContext, new_id
from deltafin.serving.logprobs import completion_logprobs
from deltafin.serving.plan import Budget, token_budget
from deltafin.serving.ruled import serve_with_rules
from deltafin.serving.sse import ChunkStream, StreamingResponse
from deltafin.serving.thinking_budget import budgeted, check_budget, reasoning_budget, with_reasoning_tokens


class CompletionService:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    def budget(self, request: CompletionRequest, rule_ctx: RuleContext, stats: RequestStats) -> Budget:
        """An explicit max_tokens is honoured; else the seed's default for raw completions
        (`server.completion_default_max_tokens`, 256), or the model's own (model.sampling), as the rules leave it;
        either bounded by the room left."""
        default = None
        if request.max_tokens is None:
            endpoint_default = (
                self.ctx.sampling_defaults.max_tokens or self.ctx.config.server.completion_default_max_tokens
            )
            default = self.ctx.rules.default_max_tokens(request, rule_ctx, stats.rules, endpoint_default)
        return Budget(request.max_tokens, default, param="prompt")

    def jobs(self, request: CompletionRequest, prompts: list[_Prompt], budget: Budget) -> list[GenerationJob]:
        """n jobs per prompt, prompt-major (choice index = prompt index * n + i), as vLLM numbers them."""
        limits = self.ctx.config.server
        request.check(max_n=limits.max_n, max_stop=limits.max_stop_sequences, max_top_logprobs=limits.max_top_logprobs)
        return [
            job
            for prompt in prompts
            for job in self._budgeted(request, prompt, self._prompt_jobs(request, prompt.ids, budget))
        ]

    def _budgeted(self, request: CompletionRequest, prompt: _Prompt, jobs: list[GenerationJob]) -> list[GenerationJob]:
        """The thinking budget, where the prompt leaves the model inside reasoning (or free to open it)."""
        if request.thinking_token_budget is None:
            return jobs
        model = self.ctx.config.model
        budget = reasoning_budget(
            request.thinking_token_budget, model=model, prompt_text=prompt.text, tokenizer=self.ctx.tokenizer
        )
        return budgeted(jobs, budget)

    def _prompt_jobs(self, request: CompletionRequest, prompt_ids: list[int], budget: Budget) -> list[GenerationJob]:
        if not prompt_ids:  # the protocol refuses "", this is for a tokenizer that yields nothing for a text
            raise InvalidRequestError("the prompt is empty", param="prompt")
        max_tokens = token_budget(self.ctx.engine.context_length, len(prompt_ids), budget)
        ids = tuple(prompt_ids)
        # echo + logprobs reports the prompt's tokens too, as OpenAI does.
        prompt_logprobs = request.logprobs if request.echo else None
        if prompt_logprobs is not None and not self.ctx.engine.capabilities.prompt_logprobs:
            # Refused rather than answered without them: a client scoring prompts must not get silent gaps.
            raise InvalidRequestError(
                f"echo with logprobs (the prompt's own logprobs) is not available with the {self.ctx.engine.name} "
                "engine; drop `echo` or `logprobs`.",
                param="echo",
            )
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
            check_budget(request.thinking_token_budget, self.ctx.config.model, self.ctx.model_name)
            prompts = [
                await self._prompt(request, prompt, stats) for prompt in request.prompts(self.ctx.engine.vocab_size)
            ]
            jobs = self.jobs(request, prompts, self.budget(request, rule_ctx, stats))
            stats.prompt_tokens = sum(len(prompt.ids) for prompt in prompts)  # each prompt once, as vLLM counts
            # the prompt of each choice
            of_choice = [prompt for prompt in prompts for _ in range(request.n)]
            stream = await self.ctx.engine.start(self.ctx.scoped(jobs, stats), deadline=self.ctx.deadline(stats))
            stats.queue_wait_s = stream.queue_wait
            if request.stream:
                return ChunkStream(
                    self._chunks(request, of_choice, stream, stats), stream.close, ready=stream.has_events()
                )
            return await self._collect(request, of_choice, stream, stats)

        return await serve_with_rules(self.ctx, request, rule_ctx, stats, produce)

    async def _prompt(self, request: CompletionRequest, prompt: str | list[int], stats: RequestStats) -> _Prompt:
        # ctx.tokenizer is the prompt thread's own (deltafin.serving.prompt_work), so it is read on that thread.
        size = stats.body_bytes
        if isinstance(prompt, str):
            # A raw prompt is the client's whole input: special tokens in it are meant as such.
            ids = await self.ctx.off_loop(lambda: list(self.ctx.tokenizer(prompt).input_ids), size=size, stats=stats)
            return _Prompt(ids, prompt)
        ids = prompt
        # Token ids in: the echoed text is their decoding, special tokens included (a thinking budget reads
        # where the prompt leaves the model off it too).
        if not request.echo and request.thinking_token_budget is None:
            return _Prompt(ids, "")
        text = await self.ctx.off_loop(
            lambda: self.ctx.tokenizer.decode(ids, skip_special_tokens=False), size=size, stats=stats
        )
        return _Prompt(ids, text)

    def _token_text(self, request: CompletionRequest) -> Any:
        if request.return_tokens_as_token_ids:
            return _token_id_text
        return self.ctx.token_text

    def _base(self) -> dict[str, Any]:
        return {
            "id": new_id("cmpl"),
            "object": "text_completion",
            "created": self.ctx.created_now(),
            "model": self.ctx.model_name,
        }

    async def _collect(
        self, request: CompletionRequest, prompts: list[_Prompt], stream: GenerationStream, stats: RequestStats
    ) -> dict[str, Any]:
        n = len(prompts)
        token_text = self._token_text(request)
        ids: list[list[int]] = [[] for _ in range(n)]
        texts: list[list[str]] = [[] for _ in range(n)]
        logprobs: list[list[TokenLogprob]] = [[] for _ in range(n)]
        finished: list[Finished | None] = [None] * n
        prompt_logprobs: list[PromptLogprobs | None] = [None] * n
        async for event in stream:
            if isinstance(event, TextDelta):
                stats.saw(event)
                if event.text:
                    stats.first_token()
                texts[event.choice].append(event.text)
                logprobs[event.choice].extend(event.logprobs)
                ids[event.choice].extend(event.token_ids)
            elif isinstance(event, PromptLogprobs):
                prompt_logprobs[event.choice] = event
            else:
                finished[event.choice] = event
                stats.record(event)
        choices = []
        for index in range(n):
            prompt = prompts[index]
            prefix = prompt.text if request.echo else ""
            end = finished[index]
            assert end is not None
            choice = {
                "index": index,
                "text": prefix + "".join(texts[index]),
                "logprobs": completion_logprobs(logprobs[index], token_text, len(prefix), prompt_logprobs[index])
                if request.logprobs is not None
                else None,
                "finish_reason": end.reason,
            }
            if request.return_token_ids:
                choice.update(prompt_token_ids=prompt.ids, token_ids=ids[index])
            choices.append(choice)
        return {**self._base(), "choices": choices, "usage": self._usage(request, stats, finished)}

    def _usage(self, request: CompletionRequest, stats: RequestStats, finished: list[Finished | None]) -> dict:
        usage = self.ctx.usage(stats.prompt_tokens, stats.completion_tokens, stats.cached_tokens)
        if request.thinking_token_budget is None:
            return usage
        return with_reasoning_tokens(usage, sum(end.reasoning_tokens or 0 for end in finished if end is not None))

    async def _chunks(
        self, request: CompletionRequest, prompts: list[_Prompt], stream: GenerationStream, stats: RequestStats
    ) -> AsyncIterator[dict[str, Any]]:
        base = self._base()
        include_usage = request.include_usage
        token_text = self._token_text(request)
        offsets: dict[int, int] = {}
        # return_token_ids: ids of held-back text wait for the next chunk that is sent (or the last one).
        pending_ids: dict[int, list[int]] = {}
        announced: set[int] = set()

        def chunk(index: int, text: str, *, finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
            choice: dict[str, Any] = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
            if request.return_token_ids:
                choice["token_ids"] = pending_ids.pop(index, [])
                if index not in announced:
                    announced.add(index)
                    choice["prompt_token_ids"] = prompts[index].ids
            body = {**base, "choices": [choice]}
            if include_usage:
                body["usage"] = None
            return body

        pending: dict[int, list[TokenLogprob]] = {}
        ended: list[Finished | None] = []
        async for event in stream:
            index = event.choice
            if index not in offsets:
                offsets[index] = 0
                prompt = prompts[index]
                if request.echo:
                    offsets[index] = len(prompt.text)
                    prompt_lp = None
                    if isinstance(event, PromptLogprobs):
                        prompt_lp = completion_logprobs((), token_text, 0, event)
                    yield chunk(index, prompt.text, logprobs=prompt_lp)
            if isinstance(event, PromptLogprobs):
                continue
            if isinstance(event, TextDelta):
                stats.saw(event)
                pending.setdefault(index, []).extend(event.logprobs)
                pending_ids.setdefault(index, []).extend(event.token_ids)
                if not event.text:
                    continue
                stats.first_token()
                lp = None
                if request.logprobs is not None:
                    lp = completion_logprobs(pending.pop(index, []), token_text, offsets[index])
                offsets[index] += len(event.text)
                yield chunk(index, event.text, logprobs=lp)
            else:
                stats.record(event)
                ended.append(event)
                yield chunk(index, "", finish=event.reason)
        if include_usage:
            yield {**base, "choices": [], "usage": self._usage(request, stats, ended)}


@dataclass(frozen=True)
class _Prompt:
    ids: list[int]
    #: what `echo` repeats: the prompt string, or the decoding of a token-id prompt
    text: str


def _token_id_text(token_id: int) -> str:
    return f"token_id:{token_id}"
