"""Typed /v1/completions requests."""

from __future__ import annotations

from typing import Annotated, Optional

from msgspec import Meta

from deltafin.errors import InvalidRequestError
from deltafin.protocol.common import PositiveInt, SamplingFields


class CompletionRequest(SamplingFields, kw_only=True):
    # An empty prompt has no token to condition on (this tokenizer adds no BOS): 400, not generation from nothing.
    prompt: Annotated[str, Meta(min_length=1)]
    max_tokens: Optional[PositiveInt] = None
    echo: bool = False
    # Completions' logprobs is the number of alternatives per position (0 = only the chosen token).
    logprobs: Optional[Annotated[int, Meta(ge=0)]] = None
    suffix: Optional[str] = None

    def check(self, *, max_n: int, max_stop: int, max_top_logprobs: int) -> None:
        if self.n > max_n:
            raise InvalidRequestError(f"n must be at most {max_n}", param="n")
        if len(self.stop_list()) > max_stop:
            raise InvalidRequestError(f"at most {max_stop} stop sequences are allowed", param="stop")
        if self.logprobs is not None and self.logprobs > max_top_logprobs:
            raise InvalidRequestError(f"logprobs must be at most {max_top_logprobs}", param="logprobs")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported by this model", param="suffix")
