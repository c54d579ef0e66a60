"""/v1/chat/completions: rules, render, check the context, generate, assemble JSON or SSE chunks."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from deltafin.engine import Finished, GenerationJob, GenerationStream, TextDelta, TokenLogprob
from deltafin.errors import InvalidRequestError
from deltafin.markup import OutputParser, ParsedDelta
from deltafin.markup.forced_json import ForcedJsonCallParser, arguments_only
from deltafin.markup.parsing import random_call_id
from deltafin.prompt import PromptOptions, RenderedPrompt
from deltafin.prompt.sandbox import TemplateBudget, template_budget
from deltafin.protocol.chat import ChatCompletionRequest
from deltafin.rules import RuleContext
from deltafin.serving.chat_constraint import ToolUse, prepared_constraint, tool_use
from deltafin.serving.context import RequestStats, ServingContext, new_id
from deltafin.serving.logprobs import chat_logprobs
from deltafin.serving.plan import Budget, RequestPlan, plan_chat
from deltafin.serving.ruled import Frame, serve_with_rules
from deltafin.serving.sse import ChunkStream, FollowedChunk, StreamingResponse, encode_sse
from deltafin.serving.thinking_budget import chat_budget, check_budget, with_reasoning_tokens


@dataclass
class ChoiceAssembly:
    """One choice's parser and everything it produced so far."""

    parser: OutputParser
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: Finished | None = None

    def add(self, parsed: ParsedDelta) -> ParsedDelta:
        self.content.append(parsed.content)
        self.reasoning.append(parsed.reasoning)
        for delta in parsed.tool_calls:
            call = self.tool_calls.setdefault(
                delta.index, {"id": delta.id, "type": "function", "function": {"name": delta.name, "arguments": ""}}
            )
            call["function"]["arguments"] += delta.arguments
        return parsed

    @property
    def finish_reason(self) -> str:
        assert self.finished is not None
        if self.tool_calls and self.finished.reason == "stop":
            return "tool_calls"
        return self.finished.reason

    def message(self) -> dict[str, Any]:
        content = "".join(self.content)
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not self.tool_calls else None}
        reasoning = "".join(self.reasoning)
        if reasoning:
            message["reasoning_content"] = reasoning
        if self.tool_calls:
            message["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        return message


def brings_template(request: Any) -> bool:
    """Whether a request (chat, or /tokenize with messages) brings its own chat template."""
    return "chat_template" in (getattr(request, "chat_template_kwargs", None) or {})


def tool_call_deltas(parsed: ParsedDelta) -> list[dict[str, Any]]:
    """OpenAI tool-call deltas: the first of a call has index, id, type, name and empty arguments; later ones
    index and argument fragments (adjacent fragments of one call are merged)."""
    out: list[dict[str, Any]] = []
    for delta in parsed.tool_calls:
        if delta.id is not None:
            out.append(
                {
                    "index": delta.index,
                    "id": delta.id,
                    "type": "function",
                    "function": {"name": delta.name, "arguments": delta.arguments},
                }
            )
        elif out and out[-1]["index"] == delta.index and "id" not in out[-1]:
            out[-1]["function"]["arguments"] += delta.arguments  # never into a head: its arguments stay ""
        else:
            out.append({"index": delta.index, "function": {"arguments": delta.arguments}})
    return out


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
        kwargs = dict(request.chat_template_kwargs or {})
        templates = self.ctx.config.server.templates
        # A request's own template could put real control tokens in the prompt and drop the operator's system
        # prompt; only an operator who trusts every client turns that on (vLLM: --trust-request-chat-template).
        if "chat_template" in kwargs and not templates.trust_request_chat_template:
            raise InvalidRequestError(
                "chat_template_kwargs.chat_template is not accepted by this server "
                "(server.templates.trust_request_chat_template is off)",
                param="chat_template_kwargs.chat_template",
            )
        # What else shapes the prompt: K3 writes tool_choice and response_format as system messages, and every
        # format reads reasoning_effort (K3 maps it to its thinking effort; templates get it as vLLM passes it).
        options = PromptOptions(request.tool_choice, request.response_format, request.reasoning_effort)
        with template_budget(TemplateBudget(templates.render_timeout_s, templates.max_rendered_chars)):
            return self.ctx.chat_format.render(
                request.messages, request.tools, kwargs, add_generation_prompt=add_generation_prompt, options=options
            )

    def budget(
        self, request: ChatCompletionRequest, rule_ctx: RuleContext, stats: RequestStats, *, fit: bool = False
    ) -> Budget:
        """How the request's completion budget is chosen: its own max tokens, else the rules' default (none:
        run to EOS, bounded by the context); `fit`: its own is an upper bound (see deltafin.serving.plan)."""
        requested = request.requested_max_tokens()
        param = "max_completion_tokens" if request.max_completion_tokens is not None else "messages"
        default = None
        if requested is None:  # the model's default (model.sampling), as the rules leave it
            model_default = self.ctx.sampling_defaults.max_tokens
            default = self.ctx.rules.default_max_tokens(request, rule_ctx, stats.rules, model_default)
        return Budget(requested, default, fit=fit, param=param)

    def plan(
        self, request: ChatCompletionRequest, prompt: RenderedPrompt, tools: ToolUse, budget: Budget
    ) -> RequestPlan:
        limits = self.ctx.config.server
        request.check(max_n=limits.max_n, max_stop=limits.max_stop_sequences, max_top_logprobs=limits.max_top_logprobs)
        return plan_chat(
            request, self.ctx.family, tools, prompt, context_length=self.ctx.engine.context_length, budget=budget
        )

    def jobs(self, request: ChatCompletionRequest, plan: RequestPlan) -> list[GenerationJob]:
        ids = tuple(plan.prompt.token_ids)
        return [
            GenerationJob(
                ids,
                request.sampling_params(
                    max_tokens=plan.max_tokens,
                    vocab_size=self.ctx.engine.vocab_size,
                    logprobs=request.logprobs,
                    top_logprobs=request.top_logprobs or 0,
                    choice=i,
                ),
            )
            for i in range(request.n)
        ]

    async def constrained(
        self, plan: RequestPlan, jobs: list[GenerationJob], stats: RequestStats
    ) -> list[GenerationJob]:
        """The jobs with the plan's constraint (response_format, enforced tool_choice), if any, and its grammar
        compiled (waited for here, in the request's own lane: see deltafin.grammar.service)."""
        if plan.constraint is None:
            return jobs
        grammar = await prepared_constraint(plan.constraint, self.ctx, stats)
        constraint = plan.constraint[0]
        return [replace(job, params=replace(job.params, constraint=constraint), grammar=grammar) for job in jobs]

    def output_parser(self, request: ChatCompletionRequest, prompt_text: str, tools: ToolUse) -> OutputParser:
        """Tool calls are parsed only when the request declares tools and allows calls."""
        if tools.forced_json is not None:  # a family without a tool-call syntax: the call was forced as plain JSON
            return ForcedJsonCallParser(random_call_id, name=arguments_only(tools.forced_json))
        return self.ctx.family.output_parser(
            prompt_text=prompt_text,
            tool_schemas=request.tools,
            calls_allowed=tools.calls_allowed,
            history_calls=sum(len(m.tool_calls or ()) for m in request.messages),
        )

    async def create(
        self,
        request: ChatCompletionRequest,
        stats: RequestStats,
        *,
        frame: Frame = encode_sse,
        rule_ctx: RuleContext | None = None,
        fit_max_tokens: bool = False,
    ) -> dict[str, Any] | StreamingResponse:
        """`frame` turns the streamed chunks into the SSE body (/v1/responses, /v1/messages send their own
        events); `rule_ctx` is read back by callers that need what serving counted (reasoning tokens);
        `fit_max_tokens`: the request's max tokens is cut to the room its prompt leaves instead of refused."""
        rule_ctx = rule_ctx or self.rule_context(request)

        async def produce(request: ChatCompletionRequest) -> dict[str, Any] | ChunkStream:
            self.ctx.check_model(request.model)
            tools = tool_use(request, self.ctx.family, self.ctx.model_name)
            check_budget(request.thinking_token_budget, self.ctx.config.model, self.ctx.model_name)
            # A request's own template is code of unknown cost: never run on the event loop.
            prompt = await self.ctx.off_loop(
                self.render, request, size=stats.body_bytes, stats=stats, inline=not brings_template(request)
            )
            stats.prompt_tokens = len(prompt.token_ids)
            plan = self.plan(request, prompt, tools, self.budget(request, rule_ctx, stats, fit=fit_max_tokens))
            jobs = await self.constrained(plan, self.jobs(request, plan), stats)
            jobs = chat_budget(request, prompt.text, jobs, self.ctx, tools)
            choices = [ChoiceAssembly(self.output_parser(request, prompt.text, tools)) for _ in jobs]
            stream = await self.ctx.engine.start(self.ctx.scoped(jobs, stats), deadline=self.ctx.deadline(stats))
            stats.queue_wait_s = stream.queue_wait
            if request.stream:
                return ChunkStream(
                    self._chunks(request, stream, choices, stats, rule_ctx), stream.close, ready=stream.has_events()
                )
            return await self._collect(request, stream, choices, stats, rule_ctx)

        return await serve_with_rules(self.ctx, request, rule_ctx, stats, produce, frame)

    def _finish(
        self, choice: ChoiceAssembly, event: Finished, stats: RequestStats, rule_ctx: RuleContext
    ) -> ParsedDelta:
        parsed = choice.add(choice.parser.finish(event.reason))
        choice.finished = event
        stats.record(event)
        reasoning = "".join(choice.reasoning)
        # reasoning tokens are part of completion_tokens; rules may report them separately. A choice with a
        # thinking budget has them counted by the engine, token by token.
        if event.reasoning_tokens is not None:
            rule_ctx.reasoning_tokens += event.reasoning_tokens
        elif reasoning:
            rule_ctx.reasoning_tokens += self.ctx.count_tokens(reasoning)
        return parsed

    def _usage(self, request: ChatCompletionRequest, stats: RequestStats, rule_ctx: RuleContext) -> dict[str, Any]:
        usage = self.ctx.usage(stats.prompt_tokens, stats.completion_tokens, stats.cached_tokens)
        if request.thinking_token_budget is None:
            return usage
        return with_reasoning_tokens(usage, rule_ctx.reasoning_tokens)

    async def _collect(
        self,
        request: ChatCompletionRequest,
        stream: GenerationStream,
        choices: list[ChoiceAssembly],
        stats: RequestStats,
        rule_ctx: RuleContext,
    ) -> dict[str, Any]:
        async for event in stream:
            choice = choices[event.choice]
            if isinstance(event, TextDelta):
                stats.saw(event)
                if event.text:
                    stats.first_token()
                    choice.add(choice.parser.feed(event.text))
                choice.logprobs.extend(event.logprobs)
            elif isinstance(event, Finished):
                self._finish(choice, event, stats, rule_ctx)
        body_choices = []
        for index, choice in enumerate(choices):
            logprobs = {"content": chat_logprobs(choice.logprobs, self.ctx.token_text)} if request.logprobs else None
            body_choices.append(
                {
                    "index": index,
                    "message": choice.message(),
                    "logprobs": logprobs,
                    "finish_reason": choice.finish_reason,
                    # vLLM's: the stop string or stop token id that ended the choice (None: EOS, length)
                    "stop_reason": choice.finished.stop_reason if choice.finished else None,
                }
            )
        return {
            **self._envelope("chat.completion"),
            "choices": body_choices,
            "usage": self._usage(request, stats, rule_ctx),
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
        choices: list[ChoiceAssembly],
        stats: RequestStats,
        rule_ctx: RuleContext,
    ) -> AsyncIterator[dict[str, Any]]:
        base = self._envelope("chat.completion.chunk")
        include_usage = request.include_usage

        def chunk(index: int, delta: dict[str, Any], *, finish: str | None = None, logprobs: Any = None) -> dict:
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            if finish is not None:  # vLLM's stop_reason, as in the whole body
                choice["stop_reason"] = choices[index].finished.stop_reason  # type: ignore[union-attr]  # a finish chunk is sent only after its choice finished
            body = {**base, "choices": [choice]}
            if include_usage:
                body["usage"] = None
            return body

        def delta_chunk(index: int, parsed: ParsedDelta) -> dict:
            delta: dict[str, Any] = {}
            if parsed.reasoning:
                delta["reasoning_content"] = parsed.reasoning
            if parsed.content:
                delta["content"] = parsed.content
            if parsed.tool_calls:
                delta["tool_calls"] = tool_call_deltas(parsed)
            logprobs = None
            if request.logprobs:
                logprobs = {"content": chat_logprobs(pending.pop(index, []), self.ctx.token_text)}
            return chunk(index, delta, logprobs=logprobs)

        started: set[int] = set()
        pending: dict[int, list[TokenLogprob]] = {}
        async for event in stream:
            index = event.choice
            out: list[dict] = []
            if isinstance(event, TextDelta):
                stats.saw(event)
                pending.setdefault(index, []).extend(event.logprobs)
                if event.text:
                    stats.first_token()
                    parsed = choices[index].add(choices[index].parser.feed(event.text))
                    if parsed.content or parsed.reasoning or parsed.tool_calls:
                        out.append(delta_chunk(index, parsed))
            elif isinstance(event, Finished):
                parsed = self._finish(choices[index], event, stats, rule_ctx)
                if parsed.content or parsed.reasoning or parsed.tool_calls:
                    out.append(delta_chunk(index, parsed))
                out.append(chunk(index, {}, finish=choices[index].finish_reason))
            if index not in started:  # a choice's first event: the role chunk first, with what follows at once
                started.add(index)
                role = chunk(index, {"role": "assistant", "content": ""})
                yield FollowedChunk(role) if out else role
            for item in out:
                yield item
        if include_usage:
            yield {**base, "choices": [], "usage": self._usage(request, stats, rule_ctx)}
