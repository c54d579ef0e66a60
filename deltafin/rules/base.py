"""The rule protocol: up to five optional hooks, configured only through the constructor.

Conventions every rule follows (and the pipeline relies on):
- Pure: no I/O, no globals, no engine. A hook sees the typed request or plain response dicts and a
  `RuleContext` (model family, endpoint, context length, counts the serving layer filled in).
- A hook that does not act returns its input object itself; one that acts returns a new object
  (`msgspec.structs.replace`, a new dict; another value for `default_max_tokens`). Identity is how the
  pipeline knows which rules changed a request.
- A hook rejects a request by raising a `DeltafinError`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import ClassVar

from deltafin.errors import DeltafinError
from deltafin.protocol.chat import ChatCompletionRequest
from deltafin.protocol.completions import CompletionRequest

Request = ChatCompletionRequest | CompletionRequest
Chunk = dict


@dataclass
class RuleContext:
    """What a rule may know about the request beyond its body. Filled by the serving layer."""

    family: str
    endpoint: str  # "chat" | "completions" | "tokenize"
    context_length: int
    stream: bool = False
    include_usage: bool = False
    reasoning_tokens: int = 0


class Rule:
    """Base class: every hook leaves its input alone."""

    #: Hold a streamed response's HTTP status until its first chunk exists (see streaming_error_preflight).
    preflight: ClassVar[bool] = False

    def request(self, request: Request, ctx: RuleContext) -> Request:
        return request

    def default_max_tokens(self, default: int | None, request: Request, ctx: RuleContext) -> int | None:
        """The completion budget of a request that names no max tokens, given the one before this rule: the
        endpoint's own (None: run to EOS, bounded by the context) or an earlier rule's. Serving bounds it by the
        room the prompt leaves; it is never a reason to refuse a request."""
        return default

    def response(self, body: dict, ctx: RuleContext) -> dict:
        return body

    def stream(self, chunks: AsyncIterator[Chunk], ctx: RuleContext) -> AsyncIterator[Chunk] | None:
        """Return a wrapping iterator to act on this stream, or None to leave it alone."""
        return None

    def error(self, error: DeltafinError, ctx: RuleContext) -> DeltafinError:
        return error
