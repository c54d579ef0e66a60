"""Typed /v1/completions requests."""

from __future__ import annotations

from typing import Annotated, Any

from msgspec import Meta

from deltafin.errors import InvalidRequestError
from deltafin.protocol.common import PositiveInt, SamplingFields

TokenId = Annotated[int, Meta(ge=0)]
#: prompts x n of one request at most: each is a row of the batch (vLLM sets no bound; one is kept here so a
#: single request cannot queue thousands of generations)
MAX_CHOICES = 256


class CompletionRequest(SamplingFields, kw_only=True):
    # A string, token ids, or a list of either (a batch: one choice per prompt, times n), as OpenAI and vLLM
    # accept them (ids are checked against the vocabulary). None may be empty: with no token to condition on (this
    # tokenizer adds no BOS) it is a 400, not generation from nothing. The list forms are checked in `prompts`
    # (msgspec cannot tell a list of ids from a list of strings in one union).
    prompt: Annotated[str, Meta(min_length=1)] | Annotated[list[Any], Meta(min_length=1)]
    max_tokens: PositiveInt | None = None
    echo: bool = False
    # Completions' logprobs is the number of alternatives per position (0 = only the chosen token).
    logprobs: Annotated[int, Meta(ge=0)] | None = None
    suffix: str | None = None
    # vLLM's extensions: the prompt's and each choice's token ids in the answer; logprob tokens as "token_id:N".
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False

    def check(self, *, max_n: int, max_stop: int, max_top_logprobs: int) -> None:
        if self.n > max_n:
            raise InvalidRequestError(f"n must be at most {max_n}", param="n")
        if len(self.stop_list()) > max_stop:
            raise InvalidRequestError(f"at most {max_stop} stop sequences are allowed", param="stop")
        if self.logprobs is not None and self.logprobs > max_top_logprobs:
            raise InvalidRequestError(f"logprobs must be at most {max_top_logprobs}", param="logprobs")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported by this model", param="suffix")

    def prompts(self, vocab_size: int) -> list[str | list[int]]:
        """The prompts, each a string or token ids inside the vocabulary: one for a string or a list of ids, each
        entry of a list of strings or of a list of id lists."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if all(_is_id(token) for token in prompt):
            return [_token_ids(prompt, vocab_size, "prompt")]
        if all(isinstance(entry, str) for entry in prompt):
            for i, entry in enumerate(prompt):
                if not entry:
                    raise InvalidRequestError(f"prompt[{i}] must not be empty", param=f"prompt[{i}]")
            prompts: list[str | list[int]] = list(prompt)
        elif all(isinstance(entry, list) for entry in prompt):
            prompts = [_token_ids(entry, vocab_size, f"prompt[{i}]") for i, entry in enumerate(prompt)]
        else:
            raise InvalidRequestError(
                "prompt must be a string, a list of token ids, a list of strings or a list of token-id lists",
                param="prompt",
            )
        if len(prompts) * self.n > MAX_CHOICES:
            raise InvalidRequestError(f"prompts x n must be at most {MAX_CHOICES}", param="prompt")
        return prompts


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids(entry: list[Any], vocab_size: int, param: str) -> list[int]:
    if not entry:
        raise InvalidRequestError(f"{param} must not be an empty list of token ids", param=param)
    for token in entry:
        if not _is_id(token) or token < 0:
            raise InvalidRequestError(f"{param}: token ids are non-negative integers", param=param)
        if token >= vocab_size:
            raise InvalidRequestError(
                f"{param}: token id {token} is outside the vocabulary (size {vocab_size})", param=param
            )
    return list(entry)
