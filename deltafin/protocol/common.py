"""Request fields shared by chat and completions, and their mapping to SamplingParams."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta, Struct

from deltafin.errors import InvalidRequestError
from deltafin.protocol.sampling import SamplingParams

MAX_STOP_CHARS = 1024
GREEDY_BELOW = 1e-5

PositiveInt = Annotated[int, Meta(ge=1)]
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
UnitOpenLeft = Annotated[float, Meta(gt=0.0, le=1.0)]
Unit = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
# HF-style: positive logits are divided by it. Near 0 that overflows to inf and the sampler sees NaN, so it is
# bounded away from 0 (vLLM requires > 0; 0.01 keeps a 100x boost, far past any useful setting).
RepetitionPenalty = Annotated[float, Meta(ge=0.01, le=10.0)]


class StreamOptions(Struct, kw_only=True):
    include_usage: bool = False


class SamplingFields(Struct, kw_only=True):
    """Sampling fields common to /v1/chat/completions and /v1/completions."""

    model: str | None = None
    n: PositiveInt = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)] | None = None
    temperature: Temperature | None = None
    top_p: UnitOpenLeft | None = None
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    min_p: Unit | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    logit_bias: dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]] | None = None
    stop_token_ids: list[Annotated[int, Meta(ge=0)]] | None = None
    ignore_eos: bool = False
    user: str | None = None
    # The most reasoning tokens a choice may write (vLLM's name; Anthropic's thinking.budget_tokens maps onto it):
    # at the budget the family's end of reasoning is forced and the model answers (deltafin.serving.thinking_budget).
    thinking_token_budget: Annotated[int, Meta(ge=0)] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(s == "" for s in stops):
            raise InvalidRequestError("stop sequences must be non-empty strings", param="stop")
        # Matching is checked after every token: a huge stop string would let one request slow the engine.
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise InvalidRequestError(f"stop sequences may be at most {MAX_STOP_CHARS} characters", param="stop")
        return stops

    def sampling_params(
        self, *, max_tokens: int, vocab_size: int, logprobs: bool, top_logprobs: int, choice: int = 0
    ) -> SamplingParams:
        """Map OpenAI fields to engine parameters; defaults apply only where a field is None."""
        bias: list[tuple[int, float]] = []
        for key, value in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise InvalidRequestError(f"logit_bias key {key!r} is not a token id", param="logit_bias") from None
            if not 0 <= token < vocab_size:
                raise InvalidRequestError(f"logit_bias token {token} is outside the vocabulary", param="logit_bias")
            bias.append((token, float(value)))
        for token in self.stop_token_ids or ():
            if token >= vocab_size:
                raise InvalidRequestError(f"stop_token_ids: {token} is outside the vocabulary", param="stop_token_ids")
        # n > 1 with a seed: each choice gets its own stream of randomness, reproducibly.
        seed = None if self.seed is None else self.seed + choice
        temperature = 1.0 if self.temperature is None else self.temperature
        return SamplingParams(
            max_tokens=max_tokens,
            # Below this, dividing logits by the temperature overflows; it means greedy anyway.
            temperature=0.0 if temperature < GREEDY_BELOW else temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None or self.top_k < 0 else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=seed,
            presence_penalty=0.0 if self.presence_penalty is None else self.presence_penalty,
            frequency_penalty=0.0 if self.frequency_penalty is None else self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=tuple(sorted(bias)),
            stop=self.stop_list(),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            ignore_eos=self.ignore_eos,
        )
