"""Typed /v1/completions requests."""

from __future__ import annotations

from typing import Annotated, Optional, Union

from msgspec import Meta

from deltafin.errors import InvalidRequestError
from deltafin.protocol.common import PositiveInt, SamplingFields


TokenId = Annotated[int, Meta(ge=0)]


class CompletionRequest(SamplingFields, kw_only=True):
    # A string, or token ids as OpenAI and vLLM accept them (ids are checked against the vocabulary). Neither may
    # be empty: with no token to condition on (this tokenizer adds no BOS) it is a 400, not generation from nothing.
    prompt: Union[Annotated[str, Meta(min_length=1)], Annotated[list[TokenId], Meta(min_length=1)]]
    max_tokens: Optional[PositiveInt] = None
    echo: bool = False
    # Completions' logprobs is the number of alternatives per position (0 = only the chosen token).
    logprobs: Optional[Annotated[int, Meta(ge=0)]] = None
    suffix: Optional[str] = None
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

    def prompt_token_ids(self, vocab_size: int) -> list[int] | None:
        """The prompt's ids when it was given as ids (None for a string), each inside the vocabulary."""
        if isinstance(self.prompt, str):
            return None
        if not self.prompt:
            raise InvalidRequestError("prompt must not be an empty list of token ids", param="prompt")
        for token in self.prompt:
            if token >= vocab_size:
                raise InvalidRequestError(
                    f"prompt: token id {token} is outside the vocabulary (size {vocab_size})", param="prompt"
                )
        return list(self.prompt)
