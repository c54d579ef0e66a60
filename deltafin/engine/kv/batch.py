"""The cache of every running row, per layer kind, with the attention mask that hides the padding.

Rows join with their own prefilled cache (a one-row cache of the model's layer kinds) and leave at any step.
Attention layers are left-padded to one width: keys are stored already rotated for their own positions, so
padding only moves where they sit, and each row is fed its own position ids; padding columns no row needs
any more are trimmed when a row leaves. Linear-attention layers (recurrent and convolution state per row) are
joined along the batch dimension and never padded. `deltafin.engine.kv.cache_layers` holds what each kind does;
kinds it does not know are refused when the model loads.

A decode step appends one column for every row. Speculative decoding (deltafin.engine.local.speculative) feeds
a row several tokens at once and keeps only those its verification accepts: `place` lays the tokens out (after
each row's own last column, where the step writes per token, or appended after the widest row) and `accept`
masks out the rest. So a row's real tokens are the columns its mask shows, between `starts[i]` and `ends[i]`;
an appended layout can leave masked columns (holes) inside that span, which `compact` squeezes out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
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
        #: per row, its first real column and one past its last (the host's copy of the mask's shape)
        self.starts: list[int] = []
        self.ends: list[int] = []

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def width(self) -> int:
        return self.mask.shape[1]

    def add(self, row_cache: Any, length: int, copies: int = 1) -> None:
        """Appends `copies` rows that all start from `row_cache` (one row holding `length` tokens)."""
        old_width = self.width
        width = max(old_width, length)
        if self.cache is None:
            self.cache = cache_layers.cache_of([cache_layers.empty_like(layer) for layer in row_cache.layers])
        for layer, row_layer in zip(self.cache.layers, row_cache.layers):
            cache_layers.join(layer, row_layer, width=width, copies=copies)
        new_mask = torch.zeros(copies, width, dtype=torch.long, device=self.device)
        new_mask[:, width - length :] = 1
        old_mask = torch.cat([self.mask.new_zeros(self.rows, width - old_width), self.mask], dim=1)
        self.mask = torch.cat([old_mask, new_mask])
        self.positions = torch.cat([self.positions, torch.full((copies,), length, device=self.device)])
        grown = width - old_width  # the rows already here moved right by the new left padding
        self.starts = [start + grown for start in self.starts] + [width - length] * copies
        self.ends = [end + grown for end in self.ends] + [width] * copies
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
        self.ends = [mask.shape[1]] * self.rows

    def place(self, counts: Sequence[int], *, own_columns: bool) -> Placement:
        """Where each row's next `counts[i]` tokens go, for a forward that feeds them all at once.

        own_columns: row i's tokens take the columns right after its own last one (a step that writes each
        token at its own column: the native one), so no row leaves a gap. Otherwise every row's tokens are
        appended after the current width, `max(counts)` columns for every row (a torch forward appends the
        same number of positions to every row): a row with fewer tokens is fed copies of its last one, which
        see only their own row and are masked out by `accept`. The mask returned shows every fed column."""
        width = self.width
        firsts = list(self.ends) if own_columns else [width] * self.rows
        fed = list(counts) if own_columns else [max(counts)] * self.rows
        new_width = max(width, *(first + n for first, n in zip(firsts, fed)))
        mask = torch.cat([self.mask, self.mask.new_zeros(self.rows, new_width - width)], dim=1)
        for i, (first, n) in enumerate(zip(firsts, fed)):
            mask[i, first : first + n] = 1
        return Placement(list(counts), firsts, fed, mask, appended=not own_columns)

    def accept(self, placement: Placement, kept: Sequence[int]) -> None:
        """After the forward over `placement`: row i keeps the first `kept[i]` of its tokens, the rest are masked
        out; with an appended layout, columns past the last kept one of every row are cut off."""
        mask = placement.mask
        for i, (first, n, keep) in enumerate(zip(placement.firsts, placement.fed, kept)):
            if keep < n:
                mask[i, first + keep : first + n] = 0
            if keep:
                self.ends[i] = first + keep
                self.lengths[i] += keep
        self.mask = mask
        self.positions = self.positions + torch.tensor(list(kept), device=self.device)
        width = max(self.ends)
        if width < mask.shape[1] and placement.appended:  # the cut is a view
            assert self.cache is not None
            self.mask = self.mask[:, :width]
            for layer in self.cache.layers:
                cache_layers.narrow(layer, width)

    def truncate(self, row: int, length: int) -> None:
        """Row `row` keeps only its first `length` (at least one) real tokens; the others are masked out."""
        if length >= self.lengths[row]:
            return
        columns = torch.nonzero(self.mask[row]).squeeze(-1)
        self.mask[row, columns[length:]] = 0
        self.lengths[row] = length
        self.ends[row] = int(columns[length - 1]) + 1
        self.positions[row] = length

    @property
    def holes(self) -> int:
        """Masked columns inside rows' spans (between a row's first and last real column), all rows."""
        return sum(end - start - n for start, end, n in zip(self.starts, self.ends, self.lengths))

    def compact(self) -> None:
        """Rows left-padded again, every hole squeezed out (a copy of the whole cache)."""
        if not self.holes:
            return
        assert self.cache is not None
        width = max(self.lengths)
        index = torch.zeros(self.rows, width, dtype=torch.long, device=self.device)  # [B, width] source columns
        mask = torch.zeros(self.rows, width, dtype=torch.long, device=self.device)
        for i, n in enumerate(self.lengths):
            index[i, width - n :] = torch.nonzero(self.mask[i]).squeeze(-1)
            mask[i, width - n :] = 1
        for layer in self.cache.layers:
            cache_layers.gather_columns(layer, index)
        self.mask = mask
        self.starts = [width - n for n in self.lengths]
        self.ends = [width] * self.rows

    def row_cache(self, row: int) -> DynamicCache:
        """A one-row cache holding only `row`'s real tokens, detached from the batch (which keeps changing)."""
        assert self.cache is not None
        start, end = self.starts[row], self.ends[row]
        if end - start == self.lengths[row]:
            return cache_layers.cache_of(
                [cache_layers.single_row(layer, row, start, end) for layer in self.cache.layers]
            )
        columns = torch.nonzero(self.mask[row]).squeeze(-1)  # holes inside: the real columns, gathered (a copy)
        return cache_layers.cache_of(
            [cache_layers.single_row(layer, row, columns=columns) for layer in self.cache.layers]
        )

    def keep(self, rows: Sequence[int]) -> None:
        """Keeps only `rows` (in that order) and trims padding columns no kept row needs."""
        if len(rows) == self.rows:
            return
        if not rows:
            self.__init__(self.device)  # type: ignore[misc]  # an empty batch: the state a fresh one starts in
            return
        first = min(self.starts[i] for i in rows)
        last = max(self.ends[i] for i in rows)
        index = torch.tensor(list(rows), device=self.device)
        assert self.cache is not None
        for layer in self.cache.layers:
            cache_layers.select(layer, index, first, last)
        self.mask = self.mask.index_select(0, index)[:, first:last]
        self.positions = self.positions.index_select(0, index)
        self.lengths = [self.lengths[i] for i in rows]
        self.starts = [self.starts[i] - first for i in rows]
        self.ends = [self.ends[i] - first for i in rows]


@dataclass
class Placement:
    """Where one forward's tokens go (BatchKV.place): row i's `counts[i]` tokens at columns `firsts[i]` on, in
    `fed[i]` columns (more than `counts[i]` where an appended layout pads it); `mask` [B, width] shows them."""

    counts: list[int]
    firsts: list[int]
    fed: list[int]
    mask: torch.Tensor
    appended: bool
