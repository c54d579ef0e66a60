"""The cache of every running row, per layer kind, with the attention mask that hides the padding.

Rows join with their own prefilled cache (a one-row cache of the model's layer kinds) and leave at any step.
Attention layers are left-padded to one width: keys are stored already rotated for their own positions, so
padding only moves where they sit, and each row is fed its own position ids; padding columns no row needs
any more are trimmed when a row leaves. Linear-attention layers (recurrent and convolution state per row) are
joined along the batch dimension and never padded. `deltafin.engine.kv.cache_layers` holds what each kind does;
kinds it does not know are refused when the model loads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache

from deltafin.engine.kv import cache_layers


class BatchKV:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=device)  # [B, L]; 1 = a real token
        self.positions = torch.zeros(0, dtype=torch.long, device=device)  # [B] position of each row's next token
        self.lengths: list[int] = []  # real tokens per row, kept on the host so no step asks the device

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def width(self) -> int:
        return self.mask.shape[1]

    def add(self, row_cache: Any, length: int, copies: int = 1) -> None:
        """Appends `copies` rows that all start from `row_cache` (one row holding `length` tokens)."""
        width = max(self.width, length)
        if self.cache is None:
            self.cache = cache_layers.cache_of([cache_layers.empty_like(layer) for layer in row_cache.layers])
        for layer, row_layer in zip(self.cache.layers, row_cache.layers):
            cache_layers.join(layer, row_layer, width=width, copies=copies)
        new_mask = torch.zeros(copies, width, dtype=torch.long, device=self.device)
        new_mask[:, width - length :] = 1
        old_mask = torch.cat([self.mask.new_zeros(self.rows, width - self.width), self.mask], dim=1)
        self.mask = torch.cat([old_mask, new_mask])
        self.positions = torch.cat([self.positions, torch.full((copies,), length, device=self.device)])
        self.lengths += [length] * copies

    def step_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """attention mask [B, L + 1] (the new token included) and position ids [B, 1] for one decode step."""
        mask = torch.cat([self.mask, self.mask.new_ones(self.rows, 1)], dim=1)
        return mask, self.positions.unsqueeze(1)

    def advanced(self, mask: torch.Tensor) -> None:
        """One decode step appended one token to every row."""
        self.mask = mask
        self.positions = self.positions + 1
        self.lengths = [n + 1 for n in self.lengths]

    def row_cache(self, row: int) -> DynamicCache:
        """A one-row cache holding only `row`'s real tokens, detached from the batch (which keeps changing)."""
        assert self.cache is not None
        pad = self.width - self.lengths[row]
        return cache_layers.cache_of([cache_layers.single_row(layer, row, pad) for layer in self.cache.layers])

    def keep(self, rows: Sequence[int]) -> None:
        """Keeps only `rows` (in that order) and trims padding columns no kept row needs."""
        if len(rows) == self.rows:
            return
        if not rows:
            self.__init__(self.device)  # type: ignore[misc]
            return
        lengths = [self.lengths[i] for i in rows]
        trim = self.width - max(lengths)
        index = torch.tensor(list(rows), device=self.device)
        assert self.cache is not None
        for layer in self.cache.layers:
            cache_layers.select(layer, index, trim)
        self.mask = self.mask.index_select(0, index)[:, trim:]
        self.positions = self.positions.index_select(0, index)
        self.lengths = lengths
