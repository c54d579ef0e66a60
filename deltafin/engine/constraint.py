"""The per-row constrained-decoding hook: what the sampler asks of a grammar matcher (xgrammar or a fake).

The local engine builds one object per row from `SamplingParams.constraint` with the `constraint_factory` it
was given; the sampler calls `fill_mask` after penalties and logit_bias and before temperature / top-k / top-p,
`accept` with every token the row emits, and the row finishes with reason "stop" once `is_terminated()`.
"""

from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

import torch

from deltafin.protocol.sampling import Constraint


@runtime_checkable
class RowConstraint(Protocol):
    def fill_mask(self, logits: torch.Tensor) -> None:
        """logits: [V] float32; set every token the grammar does not allow next to -inf, in place."""

    def accept(self, token_id: int) -> None:
        """Advance the matcher past the token the row emitted."""

    def is_terminated(self) -> bool:
        """The grammar is complete: the row ends (finish reason "stop")."""


ConstraintFactory = Callable[[Constraint], RowConstraint]
