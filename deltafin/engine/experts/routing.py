"""The (token, choice) pairs of one experts call, computed by the slots that hold their experts.

Shared by the pool and by resident packed experts: a row's output depends only on its own input and its
expert's weights (the slots' matmuls give every row the same bits alone or in a batch), and each token's k
outputs are summed in choice order, as transformers' grouped_mm sums them.

A decode step's call has a few pairs (tokens x k, e.g. 4): sorting them by slot takes a dozen small torch ops
(a lookup table, nonzero, sort, unique_consecutive, two host syncs), each costing more than its work, so calls
of up to `FEW_PAIRS` pairs are sorted in Python from the pairs' experts as a list (`run_listed_pairs`); the
kernels get the same rows grouped the same way, so the outputs are the same bits.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

#: calls of at most this many (token, choice) pairs group them in Python (`run_listed_pairs`)
FEW_PAIRS = 64


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


def run_listed_pairs(
    slots: Any,
    module: Any,
    hidden: torch.Tensor,
    pair_experts: list[int],
    weights: torch.Tensor,
    k: int,
    slot_of: Mapping[int, int],
    out: torch.Tensor | None,
) -> torch.Tensor:
    """`run_pairs` for a call whose pairs' experts are at hand as a list (pair p: token p // k's choice p % k):
    the pairs whose expert `slot_of` maps to a slot, grouped by slot in Python."""
    chosen = sorted((slot_of[expert], pair) for pair, expert in enumerate(pair_experts) if expert in slot_of)
    slot_ids = [slot for slot, _ in chosen]
    rows = torch.tensor([pair for _, pair in chosen], dtype=torch.long, device=hidden.device)
    gathered = hidden[rows // k]
    project_runs = getattr(slots, "project_runs", None)
    if project_runs is not None:
        runs = runs_of(slot_ids)
        projected = project_runs(module, gathered, [slot for slot, _ in runs], [count for _, count in runs])
    else:
        projected = slots.project(module, gathered, torch.tensor(slot_ids, dtype=torch.long, device=hidden.device))
    weighted = projected * weights[rows].unsqueeze(-1)
    if out is None:
        out = weighted.new_empty((len(pair_experts), weighted.shape[-1]))
    out[rows] = weighted
    return out


def runs_of(slot_ids: list[int]) -> list[tuple[int, int]]:
    """Sorted slot ids -> (slot, how many rows) in order."""
    runs: list[tuple[int, int]] = []
    for slot in slot_ids:
        if runs and runs[-1][0] == slot:
            runs[-1] = (slot, runs[-1][1] + 1)
        else:
            runs.append((slot, 1))
    return runs


def combine(out: torch.Tensor, tokens: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """[T * k, H] pair outputs -> [T, H]: each token's k choices summed (deterministic, choice order)."""
    return out.view(tokens, k, -1).sum(dim=1).to(dtype)
