"""Each published format's definition, in torch: packed tensors -> the float32 weights they stand for.

    int4:  W[n, k] = (u(n, k) - 8) * scale[n, k // G]
    mxfp4: W[n, k] = E2M1[u(n, k)] * 2^(scale[n, k // 32] - 127)
           u(n, k) = (codes[n, k // 2] >> (4 * (k % 2))) & 0xF      (codes: the U8 [N, K/2] code plane)
    fp8:   W[n, k] = e4m3fn(w[n, k]) * scale_inv[grid_row(n), k // bk]
           grid_row(n) = (n // part_rows) * ceil(part_rows / bn) + (n % part_rows) // bn

Each product is computed exactly (float64) and rounded once to float32: what the C kernels decode, bit for
bit. Used where the kernels are off (`DELTAFIN_KERNELS=0`, no compiler) for one call's weights at a time, never
kept.
"""

from __future__ import annotations

import torch

from deltafin.engine.quant.formats.config import INT4, MXFP4

#: E2M1 (FP4) code -> value; bit 3 is the sign
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def nibbles(codes: torch.Tensor) -> torch.Tensor:
    """U8 [N, K/2] -> the codes U8 [N, K] (element 2j: the low nibble of byte j)."""
    return torch.stack((codes & 0x0F, codes >> 4), dim=-1).reshape(codes.shape[0], -1)


def packed4(codes: torch.Tensor, scales: torch.Tensor, fmt: str, group: int) -> torch.Tensor:
    """The float32 weights [N, K] of 4-bit `codes` (U8 [N, K/2]) with `scales` [N, K/group]."""
    u = nibbles(codes).long()
    if fmt == INT4:
        values, factors = (u - 8).double(), scales.double()
    elif fmt == MXFP4:
        values, factors = torch.tensor(E2M1, dtype=torch.float64)[u], torch.exp2(scales.double() - 127)
    else:
        raise ValueError(f"not a 4-bit format: {fmt}")
    return (values * factors.repeat_interleave(group, dim=1)).float()


def fp8_grid_rows(rows: int, block_rows: int, part_rows: int) -> torch.Tensor:
    """For each weight row, its row of the scale grid (parts of `part_rows` rows, each with its own grid)."""
    n = torch.arange(rows)
    return (n // part_rows) * -(-part_rows // block_rows) + (n % part_rows) // block_rows


def fp8(weights: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], part_rows: int) -> torch.Tensor:
    """The float32 weights [N, K] of e4m3fn bytes `weights` (U8 [N, K]) with float32 block scales."""
    rows, cols = weights.shape
    values = weights.contiguous().view(torch.float8_e4m3fn).double()
    grid = scale_inv.double()[fp8_grid_rows(rows, block[0], part_rows)]
    return (values * grid[:, torch.arange(cols) // block[1]]).float()
