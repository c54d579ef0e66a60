"""`thinking_token_budget` (chat, completions, responses; vLLM's name, and Anthropic's `thinking.budget_tokens`
once mapped): the request's cap on reasoning tokens, as the engine holds a choice to it (`ReasoningBudget`).

What a budget means on each model:
- a family that reasons (its markup has reasoning markers: Kimi K3's think channel, `<think>` for K2, GLM and
  Qwen3): at most that many tokens of reasoning, then the family's end of reasoning is forced (`</think>`;
  `<|close|>think<|sep|><|open|>response<|sep|>` for K3) and the model answers within max_tokens;
- the same family with thinking off for this request (the prompt closed reasoning): nothing to cap, accepted;
- a model that does not reason (SmolLM2, generic): a 400 naming the field, as vLLM answers a budget on a model
  served without a reasoning parser ("thinking_token_budget is set but reasoning_config is not configured").
The end is forced as the model writes it (its tokenizer's ids for the marker text, control tokens included);
a constrained generation's grammar (a forced call, response_format) lets that end through, since every such
grammar starts with the reasoning the prompt left open. `resume` is the constraint once reasoning ended, for an
upstream that Deltafin stops and resumes (deltafin.engine.upstream).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from deltafin.config import ModelConfig
from deltafin.engine import GenerationJob
from deltafin.errors import InvalidRequestError
from deltafin.families import get_family
from deltafin.markup import Markup
from deltafin.protocol.chat import ChatCompletionRequest
from deltafin.protocol.sampling import Constraint, ReasoningBudget
from deltafin.serving.chat_constraint import ToolUse, request_constraint
from deltafin.token_codec import TokenCodec

if TYPE_CHECKING:
    from deltafin.serving.context import ServingContext

FIELD = "thinking_token_budget"


def reasoning_markup(model: ModelConfig) -> Markup | None:
    """The model's markup where it reasons, else None."""
    family = get_family(model.family)
    markup = family.markup(family.variant(model.variant))
    return markup if markup is not None and markup.reasoning_markers() is not None else None


def check_budget(tokens: int | None, model: ModelConfig, served_name: str, param: str = FIELD) -> None:
    """A budget on a model that does not reason is a 400 (before anything is rendered)."""
    if tokens is not None and reasoning_markup(model) is None:
        raise InvalidRequestError(
            f"The model `{served_name}` (family {model.family}) does not reason, so it has no thinking to budget; "
            f"leave {param} out.",
            param=param,
        )


def reasoning_budget(
    tokens: int | None,
    *,
    model: ModelConfig,
    prompt_text: str,
    tokenizer: Any,
    resume: Constraint | None = None,
) -> ReasoningBudget | None:
    """The engine's budget for a prompt rendered as `prompt_text` (None: no budget, or reasoning is off there).
    `tokenizer`: the calling thread's own (encoding sets state on it)."""
    markup = reasoning_markup(model) if tokens is not None else None
    markers = markup.reasoning_markers() if markup is not None else None
    if tokens is None or markup is None or markers is None:
        return None
    mode = markup.reasoning(prompt_text)
    if mode == "disabled":
        return None
    return ReasoningBudget(
        tokens=tokens,
        ends=markers.ends,
        forced=tuple(TokenCodec(tokenizer).encode(markers.forced, split_special_tokens=False)),
        forced_text=markers.forced,
        opened=markup.prompt_endings["enabled"] if mode == "enabled" else None,
        start=markers.start if mode == "auto" else None,
        resume=resume,
    )


def after_reasoning(prompt_text: str, model: ModelConfig) -> str:
    """The prompt as a generation resumed after the forced end sees it (what a constraint's reasoning mode is
    read off for a resumed request)."""
    markup = reasoning_markup(model)
    markers = markup.reasoning_markers() if markup is not None else None
    return prompt_text + (markers.forced if markers is not None else "")


def budgeted(jobs: list[GenerationJob], budget: ReasoningBudget | None) -> list[GenerationJob]:
    """`jobs` with `budget` on each (every choice counts its own reasoning)."""
    if budget is None:
        return jobs
    return [replace(job, params=replace(job.params, reasoning_budget=budget)) for job in jobs]


def chat_budget(
    request: ChatCompletionRequest, prompt_text: str, jobs: list[GenerationJob], ctx: ServingContext, tools: ToolUse
) -> list[GenerationJob]:
    """A chat request's jobs with its thinking budget. A constrained request's budget carries the constraint it
    resumes under after the forced end (the request's own, read off the prompt with reasoning closed; `tools`:
    the request's tool use, as its plan decided it)."""
    if request.thinking_token_budget is None:
        return jobs
    model = ctx.config.model
    resume = None
    if any(job.params.constraint is not None for job in jobs):
        found = request_constraint(request, ctx.family, after_reasoning(prompt_text, model), tools)
        resume = found[0] if found is not None else None
    budget = reasoning_budget(
        request.thinking_token_budget, model=model, prompt_text=prompt_text, tokenizer=ctx.tokenizer, resume=resume
    )
    return budgeted(jobs, budget)


def with_reasoning_tokens(usage: dict[str, Any], reasoning_tokens: int) -> dict[str, Any]:
    """Usage with `completion_tokens_details.reasoning_tokens` (OpenAI's place for it), as a request with a
    budget reports it: the budget is what the client asked to see kept."""
    details = {**(usage.get("completion_tokens_details") or {}), "reasoning_tokens": reasoning_tokens}
    return {**usage, "completion_tokens_details": details}
