"""Linear layers over published quantized weights, held as stored: float32 activations in and out.

`packed4_matmul` and `fp8_matmul` run Deltafin's C kernels (`deltafin/engine/kernels/packed_quants.c`) over
tensors of any origin (a module's buffers, a views of an expert pool's slot); the modules wrap them for the
dense layers. Where the kernels are off, one call's weights are dequantized by the format's definition
(`dequantize.py`), used and dropped: slower, the same values, never a float copy kept.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F
from torch import nn

from deltafin.engine.kernels import packed
from deltafin.engine.quant.formats import dequantize
from deltafin.engine.quant.formats.config import FP8, INT4, MXFP4, UnsupportedQuantization
from deltafin.engine.quant.formats.tensors import PackedModule

#: scale dtype -> the kernel's scale type
SCALE_TYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2, torch.uint8: 3}
#: format -> the kernel's format number
FORMAT_IDS = {INT4: 1, MXFP4: 2}


def _rows(x: torch.Tensor, width: int) -> torch.Tensor:
    rows = x.reshape(-1, width)
    if rows.dtype != torch.float32:
        rows = rows.float()
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _result(failed: int) -> None:
    if failed == -2:
        raise MemoryError("the packed-weights kernel could not allocate its row buffer")
    if failed:
        raise ValueError("the packed-weights kernel refused its arguments (a loader check missed them)")


@torch.compiler.disable  # a ctypes call: a compiled step runs it as one opaque call
def packed4_matmul(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    fmt: str,
    group: int,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] (float32 rows, unit stride) @ W.T -> [M, N] float32, W the 4-bit weights of `codes` U8 [N, K/2]
    and `scales` [N, K/group] (rows of unit stride each); into `out` ([M, N], any row stride) when given."""
    width = codes.shape[1] * 2
    rows = _rows(x, width)
    if out is None:
        out = torch.empty(rows.shape[0], codes.shape[0], dtype=torch.float32)
    library = packed()
    if library is None:
        out.copy_(F.linear(rows, dequantize.packed4(codes, scales, fmt, group), bias))
        return out
    _result(
        library.deltafin_packed4_matmul(
            rows.data_ptr(),
            rows.shape[0],
            rows.stride(0),
            width,
            codes.data_ptr(),
            codes.stride(0),
            scales.data_ptr(),
            SCALE_TYPES[scales.dtype],
            scales.stride(0),
            group,
            FORMAT_IDS[fmt],
            codes.shape[0],
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            out.stride(0),
            torch.get_num_threads(),
        )
    )
    return out


@torch.compiler.disable
def fp8_matmul(
    x: torch.Tensor,
    weights: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    part_rows: int,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ W.T -> [M, N] float32, W the e4m3fn bytes `weights` U8 [N, K] times the float32 block scales
    `scale_inv` (parts of `part_rows` rows, each with its own grid)."""
    width = weights.shape[1]
    rows = _rows(x, width)
    if out is None:
        out = torch.empty(rows.shape[0], weights.shape[0], dtype=torch.float32)
    library = packed()
    if library is None:
        out.copy_(F.linear(rows, dequantize.fp8(weights, scale_inv, block, part_rows), bias))
        return out
    _result(
        library.deltafin_fp8_matmul(
            rows.data_ptr(),
            rows.shape[0],
            rows.stride(0),
            width,
            weights.data_ptr(),
            weights.stride(0),
            scale_inv.data_ptr(),
            scale_inv.stride(0),
            block[0],
            block[1],
            part_rows,
            weights.shape[0],
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            out.stride(0),
            torch.get_num_threads(),
        )
    )
    return out


@torch.compiler.disable
def grouped_matmul(
    x: torch.Tensor,
    counts: list[int],
    weights: list[tuple[torch.Tensor, torch.Tensor]],
    fmt: str,
    group: int,
    block: tuple[int, int],
    part_rows: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """Several matrices of one shape and format in one kernel call (a layer's experts): rows
    x[sum(counts[:g]) : + counts[g]] times matrix g (codes, scales) into the same rows of `out` [n, N].
    x: [n, K] float32, unit strides; `fmt` int4 / mxfp4 (with `group`) or fp8 (with `block`, `part_rows`)."""
    library = packed()
    if library is None or not counts:
        start = 0
        for count, (codes, scales) in zip(counts, weights):
            rows = slice(start, start + count)
            if fmt == FP8:
                fp8_matmul(x[rows], codes, scales, block, part_rows, out=out[rows])
            else:
                packed4_matmul(x[rows], codes, scales, fmt, group, out=out[rows])
            start += count
        return out
    groups = len(counts)
    starts = [0]
    for count in counts[:-1]:
        starts.append(starts[-1] + count)
    pointers = ctypes.c_void_p * groups
    xs = pointers(*(x.data_ptr() + start * x.stride(0) * 4 for start in starts))
    ys = pointers(*(out.data_ptr() + start * out.stride(0) * 4 for start in starts))
    row_counts = (ctypes.c_int64 * groups)(*counts)
    code_pointers = pointers(*(w[0].data_ptr() for w in weights))
    scale_pointers = pointers(*(w[1].data_ptr() for w in weights))
    first_codes, first_scales = weights[0]
    width = first_codes.shape[1] * (1 if fmt == FP8 else 2)
    common = (groups, xs, row_counts, x.stride(0), width, code_pointers, first_codes.stride(0), scale_pointers)
    if fmt == FP8:
        failed = library.deltafin_fp8_grouped(
            *common, first_scales.stride(0), block[0], block[1], part_rows, first_codes.shape[0], ys,
            out.stride(0), torch.get_num_threads(),
        )  # fmt: skip
    else:
        failed = library.deltafin_packed4_grouped(
            *common, SCALE_TYPES[first_scales.dtype], first_scales.stride(0), group, FORMAT_IDS[fmt],
            first_codes.shape[0], ys, out.stride(0), torch.get_num_threads(),
        )  # fmt: skip
    _result(failed)
    return out


def dequantized_packed4(
    codes: torch.Tensor, scales: torch.Tensor, fmt: str, group: int, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """Float32 weight rows `rows` (all when None), decoded by the kernel (the definition where it is off)."""
    library = packed()
    ids = torch.arange(codes.shape[0]) if rows is None else rows.reshape(-1).to(torch.int64).contiguous()
    if library is None:
        return dequantize.packed4(codes[ids], scales[ids], fmt, group)
    out = torch.empty(ids.shape[0], codes.shape[1] * 2, dtype=torch.float32)
    _result(
        library.deltafin_packed4_dequantize(
            codes.data_ptr(),
            codes.stride(0),
            scales.data_ptr(),
            SCALE_TYPES[scales.dtype],
            scales.stride(0),
            group,
            FORMAT_IDS[fmt],
            codes.shape[1] * 2,
            codes.shape[0],
            ids.data_ptr(),
            ids.shape[0],
            out.data_ptr(),
        )
    )
    return out


def dequantized_fp8(
    weights: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    part_rows: int,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    library = packed()
    ids = torch.arange(weights.shape[0]) if rows is None else rows.reshape(-1).to(torch.int64).contiguous()
    if library is None:
        return dequantize.fp8(weights, scale_inv, block, part_rows)[ids]
    out = torch.empty(ids.shape[0], weights.shape[1], dtype=torch.float32)
    _result(
        library.deltafin_fp8_dequantize(
            weights.data_ptr(),
            weights.stride(0),
            scale_inv.data_ptr(),
            scale_inv.stride(0),
            block[0],
            block[1],
            part_rows,
            weights.shape[1],
            weights.shape[0],
            ids.data_ptr(),
            ids.shape[0],
            out.data_ptr(),
        )
    )
    return out


class Packed4Linear(nn.Module):
    """A Linear over int4 or MXFP4 weights as a checkpoint stores them: `codes` U8 [N, K/2] (two codes a byte,
    element 2j in the low nibble) and `scales` [N, K/group] (int4: bfloat16 / float16 / float32; MXFP4: E8M0
    bytes, groups of 32)."""

    def __init__(
        self, codes: torch.Tensor, scales: torch.Tensor, fmt: str, group: int, bias: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        self.format, self.group = fmt, group
        self.out_features, self.in_features = codes.shape[0], codes.shape[1] * 2
        self.register_buffer("codes", codes.contiguous())
        self.register_buffer("scales", scales.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = packed4_matmul(x, self.get_buffer("codes"), self.get_buffer("scales"), self.format, self.group, self.bias)
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def dequantized(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        codes, scales = self.get_buffer("codes"), self.get_buffer("scales")
        return dequantized_packed4(codes, scales, self.format, self.group, rows)

    def extra_repr(self) -> str:
        return f"{self.format}, in={self.in_features}, out={self.out_features}, group={self.group}"


class FP8BlockLinear(nn.Module):
    """A Linear over e4m3fn weights U8 [N, K] with float32 `scale_inv` per block of block[0] x block[1]
    (the last ones partial), DeepSeek-V3's layout."""

    def __init__(
        self, weights: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], bias: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        self.block = (int(block[0]), int(block[1]))
        self.out_features, self.in_features = weights.shape
        self.register_buffer("codes", weights.contiguous())
        self.register_buffer("scale_inv", scale_inv.float().contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = fp8_matmul(
            x, self.get_buffer("codes"), self.get_buffer("scale_inv"), self.block, self.out_features, self.bias
        )
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def dequantized(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        return dequantized_fp8(
            self.get_buffer("codes"), self.get_buffer("scale_inv"), self.block, self.out_features, rows
        )

    def extra_repr(self) -> str:
        return f"fp8, in={self.in_features}, out={self.out_features}, block={self.block}"


def packed_linear(spec: PackedModule, codes: torch.Tensor, scales: torch.Tensor) -> nn.Module:
    """The module of a quantized dense Linear from its checkpoint tensors as read (int4's int32 words, FP8's
    e4m3fn bytes: viewed as the U8 code plane, never converted); UnsupportedQuantization for values the
    format leaves undefined (an E8M0 scale byte 255, an FP8 NaN code)."""
    plane = codes.contiguous().view(torch.uint8).reshape(spec.out_features, -1)
    if spec.format == FP8:
        if bool(((plane & 0x7F) == 0x7F).any()):
            raise UnsupportedQuantization(spec.keys["codes"], "0x7F", "an FP8 e4m3fn NaN code in the weights")
        return FP8BlockLinear(plane, scales, spec.block)
    if spec.format == MXFP4 and bool((scales == 255).any()):
        raise UnsupportedQuantization(spec.keys["scales"], 255, "E8M0 scale byte 255 is NaN in OCP MX")
    return Packed4Linear(plane, scales, spec.format, spec.group)
