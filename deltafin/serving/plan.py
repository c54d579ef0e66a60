"""One plan per generation request: what is decided about it before the engine sees it, each thing decided once.

A chat request, and everything served as one (/v1/responses, /v1/messages), is planned in two steps:
- `tool_use` (deltafin.serving.chat_constraint), before the prompt is rendered: whether the output may hold tool
  calls, and which calls a family without a tool-call syntax must make as plain JSON; a request that cannot be
  served this way is refused before any prompt work.
- `plan_chat`, with the rendered prompt: the constraint the output is generated under
  (deltafin.serving.chat_constraint) and the completion budget (`token_budget`).
/v1/completions has neither tools nor a constraint: each of its prompts gets its budget from `token_budget` too,
so every API counts the room a prompt leaves, and refuses one that does not fit, the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from deltafin.errors import ContextLengthError, InvalidRequestError
from deltafin.families import BoundFamily
from deltafin.prompt import RenderedPrompt
from deltafin.protocol.chat import ChatCompletionRequest
from deltafin.protocol.sampling import Constraint
from deltafin.serving.chat_constraint import ToolUse, request_constraint


@dataclass(frozen=True)
class Budget:
    """How a request's completion budget is chosen. `requested`: the client's max tokens (None: it named none);
    `default`: what a request that names none gets (a rule's or the endpoint's; None: what the context leaves,
    i.e. run to EOS); `fit`: the requested value is an upper bound, cut to the room the prompt leaves instead of
    refused (Anthropic clients send a fixed max_tokens whatever the model's context); `param`: the field an error
    names."""

    requested: int | None
    default: int | None = None
    fit: bool = False
    param: str = "messages"


def token_budget(context_length: int, prompt_tokens: int, budget: Budget) -> int:
    """The completion tokens a prompt of `prompt_tokens` gets. A prompt that fills the context is refused; an
    explicit max tokens is honoured exactly (refused if the prompt leaves less room) unless `fit`; a default is
    bounded by the room left. The wording of the refusals is what client-side detectors match."""
    if prompt_tokens >= context_length:
        raise ContextLengthError(
            f"This model's maximum context length is {context_length} tokens. However, your request has "
            f"{prompt_tokens} input tokens. Please reduce the length of the input.",
            context_length=context_length,
            prompt_tokens=prompt_tokens,
            param=budget.param,
        )
    room = context_length - prompt_tokens
    requested = budget.requested
    if requested is None:
        return room if budget.default is None else min(budget.default, room)
    if requested > room and not budget.fit:
        raise ContextLengthError(
            f"This model's maximum context length is {context_length} tokens. However, you requested "
            f"{prompt_tokens + requested} tokens ({prompt_tokens} in the input, {requested} in the "
            f"completion). Please reduce the length of the input or completion.",
            context_length=context_length,
            prompt_tokens=prompt_tokens,
            completion_tokens=requested,
            param=budget.param,
        )
    return min(requested, room)


@dataclass(frozen=True)
class RequestPlan:
    """Everything decided about a chat request before its jobs go to the engine."""

    prompt: RenderedPrompt
    tools: ToolUse
    #: the output's constraint and the request field it comes from (for error messages), or None: free text
    constraint: tuple[Constraint, str] | None
    #: each choice's completion budget
    max_tokens: int


def plan_chat(
    request: ChatCompletionRequest,
    family: BoundFamily,
    tools: ToolUse,
    prompt: RenderedPrompt,
    *,
    context_length: int,
    budget: Budget,
) -> RequestPlan:
    if not prompt.token_ids:
        raise InvalidRequestError("the chat template rendered an empty prompt", param="messages")
    max_tokens = token_budget(context_length, len(prompt.token_ids), budget)
    constraint = request_constraint(request, family, prompt.text, tools)
    return RequestPlan(prompt, tools, constraint, max_tokens)
