"""The per-row constrained-decoding hook: what the sampler asks of a grammar matcher (xgrammar or a fake).

A job with `SamplingParams.constraint` arrives with its grammar ready (`GenerationJob.grammar`, compiled before
the request asked for room: the engine never compiles). The local engine asks it for one `RowMatcher` per
row; the sampler calls `fill_mask` after penalties and logit_bias and before temperature / top-k / top-p,
`accept` with every token the row emits, and the row finishes with reason "stop" once `is_terminated()`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class RowMatcher(Protocol):
    def fill_mask(self, logits: torch.Tensor) -> None:
        """logits: [V] float32; set every token the grammar does not allow next to -inf, in place."""

    def accept(self, token_id: int) -> None:
        """Advance the matcher past the token the row emitted."""

    def is_terminated(self) -> bool:
        """The grammar is complete: the row ends (finish reason "stop")."""


@runtime_checkable
class MatcherSource(Protocol):
    """A constraint compiled for this engine's tokenizer (deltafin.grammar.compiled.ReadyGrammar, or a fake)."""

    def matcher(self) -> RowMatcher:
        """A fresh matcher for one row: rows of one request share the grammar, never the matcher's state."""
