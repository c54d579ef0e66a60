"""One routed expert of a published quantized checkpoint as one record: its planes as the checkpoint stores them.

| format | planes, in order, each 64-byte aligned |
|---|---|
| int4, mxfp4 | codes_gate_up U8 [2I, H/2], scales_gate_up [2I, H/G], codes_down U8 [H, I/2], scales_down [H, I/G] |
| fp8 | codes_gate_up U8 [2I, H], scales_gate_up F32 [2 ceil(I/bn), ceil(H/bk)], codes_down U8 [H, I], scales_down F32 [ceil(H/bn), ceil(I/bk)] |

gate_up is the rows of gate then up (transformers' `gate_up_proj` order; Kimi's w1 then w3); FP8's scale plane
holds gate's block grid then up's, each part its own grid (I need not be a multiple of the block). Scales keep
their stored dtype (int4: bfloat16 / float16 / float32; MXFP4: E8M0 bytes). The record is rounded up to a page,
so a copy of the experts in these records (`store.RecordCopy`) is read into a slot in one O_DIRECT read. A
record is the checkpoint's bytes moved, never converted: a miss from the checkpoint reads each piece straight
into its plane.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from deltafin.engine.quant.formats import FP8, PackedModule

#: bytes each plane is aligned to (vector loads; the kernels use unaligned loads anyway)
ALIGN = 64
#: a record starts and ends on a page: what a direct read's memory, offset and length need
PAGE = 4096

_SCALE_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "U8": torch.uint8}


@dataclass(frozen=True)
class Plane:
    name: str  # codes_gate_up | scales_gate_up | codes_down | scales_down
    part: str  # gate_up_proj | down_proj
    role: str  # codes | scales
    rows: int
    row_bytes: int
    dtype: torch.dtype
    offset: int

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes


@dataclass(frozen=True)
class PackedLayout:
    """The record of one expert of hidden size H and intermediate size I in `spec`'s format."""

    spec: PackedModule  # one projection's format (group, block, scale dtype)
    gate_up_shape: tuple[int, int]  # [2I, H]
    down_shape: tuple[int, int]  # [H, I]

    @property
    def format(self) -> str:
        return self.spec.format

    @property
    def scale_dtype(self) -> torch.dtype:
        return _SCALE_DTYPES[self.spec.scale_dtype]

    def planes(self) -> list[Plane]:
        out, at = [], 0
        item = self.spec.scale_item
        for part, (rows, cols) in (("gate_up_proj", self.gate_up_shape), ("down_proj", self.down_shape)):
            suffix = "gate_up" if part == "gate_up_proj" else "down"
            if self.format == FP8:
                bn, bk = self.spec.block
                parts = 2 if part == "gate_up_proj" else 1
                sizes = [
                    (rows, cols, torch.uint8),
                    (parts * -(-(rows // parts) // bn), -(-cols // bk) * item, torch.float32),
                ]
            else:
                sizes = [(rows, cols // 2, torch.uint8), (rows, cols // self.spec.group * item, self.scale_dtype)]
            for role, (plane_rows, row_bytes, dtype) in zip(("codes", "scales"), sizes):
                out.append(Plane(f"{role}_{suffix}", part, role, plane_rows, row_bytes, dtype, at))
                at += -(-(plane_rows * row_bytes) // ALIGN) * ALIGN
        return out

    @property
    def stride(self) -> int:
        """Bytes of a record: its planes, rounded up to a page."""
        last = self.planes()[-1]
        return -(-(last.offset + last.nbytes) // PAGE) * PAGE

    @property
    def packed_bytes(self) -> int:
        """Bytes of the expert's codes and scales (what the checkpoint holds of it)."""
        return sum(plane.nbytes for plane in self.planes())

    def plane(self, part: str, role: str) -> Plane:
        return next(p for p in self.planes() if p.part == part and p.role == role)

    def views(self, record: torch.Tensor) -> dict[str, torch.Tensor]:
        """The planes of a record (uint8 [stride]) as tensors: codes U8 [rows, bytes], scales [rows, groups]."""
        views = {}
        for plane in self.planes():
            raw = record[plane.offset : plane.offset + plane.nbytes].view(plane.rows, plane.row_bytes)
            views[plane.name] = raw.view(plane.dtype)
        return views


def packed_slot_bytes(spec: PackedModule, gate_up_shape: tuple[int, int], down_shape: tuple[int, int]) -> int:
    return PackedLayout(spec, gate_up_shape, down_shape).stride


def float_bytes(gate_up_shape: tuple[int, int], down_shape: tuple[int, int], dtype: torch.dtype) -> int:
    return (math.prod(gate_up_shape) + math.prod(down_shape)) * torch.empty((), dtype=dtype).element_size()
