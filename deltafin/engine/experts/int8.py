"""The int8 weight-only format of `placement.quantize=int8`, for pooled experts: one adapter over qlinear.

The pool quantizes an expert as it enters a slot and runs it with the same module the dense layers use
(`deltafin.engine.quant.linear.Int8Linear`: the C matvec kernel for a few rows, `_weight_int8pack_mm` for more),
so the int8 format and kernels live in one place and this file is the only one that names them.
"""

from __future__ import annotations

import torch
from torch import nn

from deltafin.engine.quant.linear import Int8Linear


def quantize_into(weight: torch.Tensor, q_out: torch.Tensor, scales_out: torch.Tensor) -> None:
    """weight [N, K] float -> `q_out` [N, K] int8 and `scales_out` [N] float32, in place."""
    quantized = Int8Linear.quantize(weight)
    q_out.copy_(quantized["weight"])
    scales_out.copy_(quantized["scales"])


def linear(q: torch.Tensor, scales: torch.Tensor) -> nn.Module:
    """A module computing x @ dequant(q).T over the slot's own tensors (no copy of the weight)."""
    return Int8Linear(q, scales, None)
