"""What goes into the engine (jobs) and what comes out of it (text deltas, then one Finished per choice)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from deltafin.protocol.sampling import SamplingParams

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class GenerationJob:
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    #: `params.constraint` compiled for the local engine's tokenizer (deltafin.engine.local.matcher.MatcherSource),
    #: prepared before the job is submitted; upstream engines send the constraint itself. Not part of the job's
    #: identity (memo keys): it is the constraint, compiled.
    grammar: Any = field(default=None, compare=False, repr=False)
    #: whose cached prefixes the job may reuse (server.prefix_cache.scope): "" shares them with every request,
    #: an API key's digest keeps them to that key's requests (the memo too: part of the job's identity)
    cache_scope: str = ""


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class TextDelta:
    """New text of one choice; `text` may be empty while bytes or a possible stop string are held back."""

    choice: int
    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class PromptLogprobs:
    """Log-probabilities of the prompt tokens (the first has none), sent before the choice's text."""

    choice: int
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob | None, ...]


@dataclass(frozen=True)
class Finished:
    choice: int
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    stop_reason: str | int | None = None
    memo_hit: bool = False
    timings: dict[str, float] = field(default_factory=dict)
    #: reasoning tokens, counted by the engine where the choice had a thinking budget (else None: serving counts
    #: them from the parsed reasoning)
    reasoning_tokens: int | None = None


#: what a generation stream carries, in order: text deltas (and prompt logprobs), then one Finished per choice
Event = TextDelta | PromptLogprobs | Finished
