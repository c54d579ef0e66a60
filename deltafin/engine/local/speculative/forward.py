"""One forward pass over several tokens of each row of the batch: how a step checks every row's draft at once.

Row i brings `counts[i]` tokens (its pending token, then its draft); the pass returns their logits, each what a
decode step feeding that token would give, and leaves their keys and values in the batch cache where
`BatchKV.place` put them (`BatchKV.accept` then keeps the accepted ones). One class per kind of decode step:

- the native GGUF step writes every token at its own row's next columns and reads the weights once for all of
  them (`NativeLlamaStep.verify`, a short prefill of each row); its logits are bit for bit a decode step's;
- the fused torch step and transformers' forward append the same number of columns to every row (rows with
  fewer tokens are padded), and match a decode step up to float reassociation.

`relative_cost`: what one more token in the pass costs, relative to a one-token decode step: the planner's
price of a guess until the passes it times say otherwise (deltafin.engine.local.speculative.cost). On the
default model on 2 cores, a native pass of 8 tokens costs about 2.3 one-token passes, a token 0.2-0.25 of one
in the engine, whether the tokens are one row's draft or eight rows' next tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from deltafin.engine.kv.batch import BatchKV, Placement
from deltafin.engine.llama.fused import FusedLlamaStep
from deltafin.engine.llama.fused_static import StaticFusedStep
from deltafin.engine.llama.native import NativeLlamaStep

#: a token's share of a decode step's cost on the CPU, before any pass is timed (see the module docstring); on
#: an accelerator a step is bound by reading the weights, whatever the token count (passes there are not timed:
#: they are queued, not done, when the call returns)
CPU_TOKEN_COST = 0.25
ACCELERATOR_TOKEN_COST = 0.05


class ManyTokenForward:
    """The interface: `run(kv, tokens, placement)` -> per row, logits [counts[i], V] (views)."""

    #: whether `BatchKV.place` gives each row its own next columns (no padding) or appends
    own_columns = False
    relative_cost = CPU_TOKEN_COST

    def run(self, kv: BatchKV, tokens: Sequence[Sequence[int]], placement: Placement) -> list[torch.Tensor]:
        raise NotImplementedError


class NativeForward(ManyTokenForward):
    own_columns = True

    def __init__(self, step: NativeLlamaStep) -> None:
        self.step = step

    def run(self, kv: BatchKV, tokens: Sequence[Sequence[int]], placement: Placement) -> list[torch.Tensor]:
        flat, rows, columns, positions = [], [], [], []
        for i, row_tokens in enumerate(tokens):
            first, length = placement.firsts[i], kv.lengths[i]
            for j, token in enumerate(row_tokens):
                flat.append(token)
                rows.append(i)
                columns.append(first + j)
                positions.append(length + j)
        assert kv.cache is not None
        logits = self.step.verify(
            torch.tensor(flat),
            torch.tensor(rows),
            torch.tensor(columns),
            torch.tensor(positions),
            placement.mask,
            kv.cache,
        )  # [T, V]
        return list(torch.split(logits, [len(t) for t in tokens]))


class _PaddedForward(ManyTokenForward):
    """Every row fed `max(counts)` tokens (the shorter ones padded with their last token) in one [B, C] pass."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.relative_cost = CPU_TOKEN_COST if device.type == "cpu" else ACCELERATOR_TOKEN_COST

    def run(self, kv: BatchKV, tokens: Sequence[Sequence[int]], placement: Placement) -> list[torch.Tensor]:
        width = max(len(t) for t in tokens)
        padded = [list(t) + [t[-1] if t else 0] * (width - len(t)) for t in tokens]
        ids = torch.tensor(padded, device=self.device)  # [B, C]
        positions = kv.positions.unsqueeze(1) + torch.arange(width, device=self.device)  # [B, C]
        logits = self.forward(ids, placement.mask, positions, kv.cache)  # [B, C, V]
        return [logits[i, : len(t)] for i, t in enumerate(tokens)]

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any) -> torch.Tensor:
        raise NotImplementedError


class FusedForward(_PaddedForward):
    def __init__(self, step: FusedLlamaStep, device: torch.device) -> None:
        super().__init__(device)
        self.step = step

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any) -> torch.Tensor:
        return self.step.verify(ids, mask, positions, cache)


class TransformersForward(_PaddedForward):
    def __init__(self, model: Any, cache_arg: str, device: torch.device) -> None:
        super().__init__(device)
        self.model = model
        self.cache_arg = cache_arg

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any) -> torch.Tensor:
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **{self.cache_arg: cache}
        )
        return out.logits  # [B, C, V]


def many_token_forward(model: Any, decode: Any, *, cache_arg: str, device: torch.device) -> ManyTokenForward:
    """The pass matching the engine's decode step `decode` (deltafin.engine.local.steps)."""
    if isinstance(decode, NativeLlamaStep):
        return NativeForward(decode)
    if isinstance(decode, StaticFusedStep):  # the eager fused pass checks drafts; the static one runs plain steps
        return FusedForward(decode.fused, device)
    if isinstance(decode, FusedLlamaStep):
        return FusedForward(decode, device)
    return TransformersForward(model, cache_arg, device)
