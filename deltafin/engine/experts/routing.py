"""The (token, choice) pairs of one experts call, computed by the slots that hold their experts.

Shared by the pool and by resident packed experts: a row's output depends only on its own input and its
expert's weights (the slots' matmuls give every row the same bits alone or in a batch), and each token's k
outputs are summed in choice order, as transformers' grouped_mm sums them.
"""

from __future__ import annotations

from typing import Any

import torch


def run_pairs(
    slots: Any,
    module: Any,
    hidden: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    k: int,
    lut: torch.Tensor,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """Compute the pairs whose expert `lut` maps to a slot (lut[expert] >= 0) into `out` [T * k, H] (made when
    None): ids, weights [T * k] (pair p is token p // k's choice p % k)."""
    pair_slots = lut[ids]  # [T * k]: the slot of each pair's expert, -1 if not in this group
    chosen = (pair_slots >= 0).nonzero().squeeze(1)
    slots_sorted, order = torch.sort(pair_slots[chosen])
    rows = chosen[order]
    projected = slots.project(module, hidden[rows // k], slots_sorted)  # [n, H]
    weighted = projected * weights[rows].unsqueeze(-1)
    if out is None:
        out = weighted.new_empty((ids.numel(), weighted.shape[-1]))
    out[rows] = weighted
    return out


def combine(out: torch.Tensor, tokens: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """[T * k, H] pair outputs -> [T, H]: each token's k choices summed (deterministic, choice order)."""
    return out.view(tokens, k, -1).sum(dim=1).to(dtype)
