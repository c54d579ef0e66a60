"""Copies of the batch's linear-attention states, to put a row's state back as it was (speculative decoding).

A recurrent state cannot be cut back to a prefix (`cache_layers`): a forward pass that fed a row tokens it then
rejects leaves a state that has seen them. So the states are copied before such a pass (`snapshot`), and a row
whose state saw tokens it does not keep gets its copy back (`restore_row`) before the tokens it keeps are fed
again. Attention layers need none of this: their rejected columns are simply masked out.
"""

from __future__ import annotations

from typing import Any

import torch

from deltafin.engine.kv.cache_layers import has_states

_TABLES = (("conv_states", "is_conv_states_initialized"), ("recurrent_states", "is_recurrent_states_initialized"))

#: per cache layer: (state index, table name) -> a copy of that state for the whole batch [B, ...]
Snapshot = list[dict[tuple[int, str], torch.Tensor]]


def _held(layer: Any) -> list[tuple[int, str]]:
    return [(i, table) for table, flags in _TABLES for i, ready in getattr(layer, flags).items() if ready]


def snapshot(cache: Any) -> Snapshot:
    """Every linear-attention state of the batch, copied."""
    return [
        {key: getattr(layer, key[1])[key[0]].clone() for key in _held(layer)} if has_states(layer) else {}
        for layer in cache.layers
    ]


def restore_row(cache: Any, saved: Snapshot, row: int, into: Any | None = None) -> None:
    """Row `row`'s states as `saved` holds them, written into `into` (a one-row cache of the same layers) or, by
    default, into row `row` of `cache` itself."""
    for index, (layer, states) in enumerate(zip(cache.layers, saved)):
        target = layer if into is None else into.layers[index]
        at = row if into is None else 0
        for (i, table), copy in states.items():
            getattr(target, table)[i][at].copy_(copy[row])


def write_row(cache: Any, row: int, source: Any) -> None:
    """Row `row` of the batch `cache` takes the states of `source` (a one-row cache of the same layers)."""
    for layer, own in zip(cache.layers, source.layers):
        if has_states(layer):
            for i, table in _held(layer):
                getattr(layer, table)[i][row].copy_(getattr(own, table)[i][0])
