"""The pool's memory: a fixed number of slots, each holding one expert's weights, and the matmuls over them.

`FloatSlots` keep the model's dtype as two tensors, `gate_up` [S, 2I, H] and `down` [S, H, I]: one grouped
matmul covers every slot a layer uses, through transformers' own `_grouped_linear` (what its `grouped_mm`
experts implementation runs), so a pooled expert's output is the resident one's, bit for bit.
`Int8Slots` keep int8 weights with one scale per output row (`placement.quantize=int8`, quantized as the expert
enters its slot), and run each slot's expert with the int8 module of the dense layers.
`PackedSlots` keep a published quantized checkpoint's experts as stored (int4, MXFP4, FP8 blocks: one record
per slot, `records.PackedLayout`), filled with the checkpoint's bytes unchanged, and run each slot's expert with
the packed-weight kernels the dense layers of those checkpoints use (`deltafin.engine.quant.formats.linear`).

`fill` runs on the pool's reader threads; it writes only its own slot, which no step reads until the read
is done (the pool's futures order the two).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from deltafin.engine.experts import int8
from deltafin.engine.experts.checkpoint import Piece
from deltafin.engine.experts.reader import ExpertReader
from deltafin.engine.experts.records import PackedLayout
from deltafin.engine.quant.formats import FP8, MXFP4, PackedModule, UnsupportedQuantization
from deltafin.engine.quant.formats.linear import grouped_matmul

#: bytes a slot's int8 tensors are aligned to (the int8 kernel's vector loads fault on unaligned rows)
_ALIGN = 64
#: an int8 slot (a record) starts and ends on a page: what a direct read's memory, offset and length need
_PAGE = 4096


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes (bfloat16 included: numpy has no such dtype)."""
    return memoryview(tensor.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]  # numpy's stubs lag: arrays are buffers


class FloatSlots:
    kind = "float"

    def __init__(
        self,
        count: int,
        gate_up_shape: tuple[int, int],
        down_shape: tuple[int, int],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.count = count
        # torch.empty: a slot's pages are touched (and counted in the process's memory) when an expert fills it
        self.gate_up = torch.empty((count, *gate_up_shape), dtype=dtype, device=device)
        self.down = torch.empty((count, *down_shape), dtype=dtype, device=device)

    @staticmethod
    def slot_bytes(gate_up_shape: Sequence[int], down_shape: Sequence[int], dtype: torch.dtype) -> int:
        return (math.prod(gate_up_shape) + math.prod(down_shape)) * torch.empty((), dtype=dtype).element_size()

    def fill(self, slot: int, pieces: Sequence[Piece], reader: ExpertReader) -> None:
        for piece in pieces:
            whole = self.gate_up[slot] if piece.part == "gate_up_proj" else self.down[slot]
            target = whole[piece.rows[0] : piece.rows[1]]
            if piece.dtype == target.dtype and target.device.type == "cpu":
                reader.read_into(piece, _bytes_of(target))  # straight from the file into the slot
            else:
                target.copy_(reader.read(piece).view(target.shape))  # dtype change or device copy

    def project(self, module: Any, x: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
        """x: [n, H] rows sorted by slot_ids [n] -> the experts' outputs [n, H] (before routing weights)."""
        from transformers.integrations.moe import _grouped_linear

        counts = torch.histc(slot_ids.float(), bins=self.count, min=0, max=self.count - 1)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        hidden = _grouped_linear(x, self.gate_up, offsets)  # [n, 2I]
        hidden = module._apply_gate(hidden)  # [n, I]
        return _grouped_linear(hidden, self.down, offsets)  # [n, H]


class Int8Slots:
    """One slot is one record: int8 gate_up and down with their float32 row scales, each tensor 64-byte aligned,
    the record page-aligned (`_PAGE`), so the int8 copy of the experts on disk (`store.RecordCopy`), which holds
    the same records, is read into a slot in one direct (O_DIRECT) read, with no copy and no conversion."""

    kind = "int8"

    def __init__(
        self,
        count: int,
        gate_up_shape: tuple[int, int],
        down_shape: tuple[int, int],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.count = count
        self.gate_up_shape, self.down_shape = tuple(gate_up_shape), tuple(down_shape)
        self.stride = Int8Slots.slot_bytes(gate_up_shape, down_shape, dtype)
        self._memory = torch.empty(count * self.stride + _PAGE, dtype=torch.uint8, device=device)
        self._base = (-self._memory.data_ptr()) % _PAGE
        self.modules: list[tuple[Any, Any] | None] = [None] * count
        self._scratch = threading.local()

    @staticmethod
    def _layout(gate_up_shape: Sequence[int], down_shape: Sequence[int]) -> list[tuple[str, int, int]]:
        """(name, bytes, offset) of the four tensors of a slot, each aligned."""
        sizes = [
            ("q_gate_up", math.prod(gate_up_shape)),
            ("s_gate_up", 4 * gate_up_shape[0]),
            ("q_down", math.prod(down_shape)),
            ("s_down", 4 * down_shape[0]),
        ]
        layout, at = [], 0
        for name, size in sizes:
            layout.append((name, size, at))
            at += -(-size // _ALIGN) * _ALIGN
        return layout

    @staticmethod
    def slot_bytes(gate_up_shape: Sequence[int], down_shape: Sequence[int], dtype: torch.dtype) -> int:
        name, size, at = Int8Slots._layout(gate_up_shape, down_shape)[-1]
        return -(-(at + size) // _PAGE) * _PAGE

    def record(self, slot: int) -> torch.Tensor:
        """The slot's bytes, uint8 [stride] (page-aligned)."""
        start = self._base + slot * self.stride
        return self._memory[start : start + self.stride]

    def views(self, record: torch.Tensor) -> dict[str, torch.Tensor]:
        """The four tensors of a record (a slot's, or a buffer of the same layout)."""
        views = {}
        for name, size, at in self._layout(self.gate_up_shape, self.down_shape):
            raw = record[at : at + size]
            shape = self.gate_up_shape if name == "q_gate_up" else self.down_shape if name == "q_down" else (-1,)
            views[name] = raw.view(torch.int8).view(shape) if name.startswith("q_") else raw.view(torch.float32)
        return views

    def _float_scratch(self) -> tuple[torch.Tensor, torch.Tensor]:
        scratch = getattr(self._scratch, "pair", None)
        if scratch is None:  # one pair per reader thread, reused for every expert it reads
            scratch = self._scratch.pair = (torch.empty(self.gate_up_shape), torch.empty(self.down_shape))
        return scratch

    def encode(self, pieces: Sequence[Piece], reader: ExpertReader, record: torch.Tensor) -> None:
        """Read an expert's float pieces from the checkpoint and quantize them into `record`."""
        gate_up, down = self._float_scratch()
        for piece in pieces:
            whole = gate_up if piece.part == "gate_up_proj" else down
            target = whole[piece.rows[0] : piece.rows[1]]
            target.copy_(reader.read(piece).view(target.shape))
        views = self.views(record)
        int8.quantize_into(gate_up, views["q_gate_up"], views["s_gate_up"])
        int8.quantize_into(down, views["q_down"], views["s_down"])

    def fill(self, slot: int, pieces: Sequence[Piece], reader: ExpertReader) -> None:
        """Quantize an expert read from the checkpoint into its slot."""
        self.encode(pieces, reader, self.record(slot))
        self.bind(slot)

    def load(self, slot: int, read: Callable[[memoryview], None]) -> None:
        """Fill the slot with a record `read` writes (from the int8 copy on disk)."""
        read(_bytes_of(self.record(slot)))
        self.bind(slot)

    def bind(self, slot: int) -> None:
        views = self.views(self.record(slot))
        self.modules[slot] = (
            int8.linear(views["q_gate_up"], views["s_gate_up"]),
            int8.linear(views["q_down"], views["s_down"]),
        )

    def project(self, module: Any, x: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
        out = torch.empty((x.shape[0], self.down_shape[0]), dtype=x.dtype, device=x.device)
        slots, counts = torch.unique_consecutive(slot_ids, return_counts=True)
        start = 0
        for slot, count in zip(slots.tolist(), counts.tolist()):
            gate_up, down = self.modules[slot]
            rows = slice(start, start + count)
            out[rows] = down(module._apply_gate(gate_up(x[rows])))
            start += count
        return out


class PackedSlots:
    """Slots of packed records (int4, MXFP4 or FP8 experts, as the checkpoint stores them)."""

    def __init__(
        self,
        count: int,
        gate_up_shape: tuple[int, int],
        down_shape: tuple[int, int],
        spec: PackedModule,
        device: torch.device,
    ) -> None:
        self.count = count
        self.layout = PackedLayout(spec, tuple(gate_up_shape), tuple(down_shape))  # type: ignore[arg-type]
        self.kind = spec.format
        self.stride = self.layout.stride
        self.intermediate, self.hidden = gate_up_shape[0] // 2, down_shape[0]
        # torch.empty: a slot's pages are touched (and counted in the process's memory) when an expert fills it
        self._memory = torch.empty(count * self.stride + _PAGE, dtype=torch.uint8, device=device)
        self._base = (-self._memory.data_ptr()) % _PAGE
        self._views: list[dict[str, torch.Tensor] | None] = [None] * count
        self._planes = {(plane.part, plane.role): plane for plane in self.layout.planes()}

    def record(self, slot: int) -> torch.Tensor:
        """The slot's bytes, uint8 [stride] (page-aligned)."""
        start = self._base + slot * self.stride
        return self._memory[start : start + self.stride]

    def encode(self, pieces: Sequence[Piece], reader: ExpertReader, record: torch.Tensor) -> None:
        """Gather an expert's pieces from the checkpoint into `record` (the copy's writer: every scale checked)."""
        self._read(pieces, reader, record)
        check_record(self.layout, record, codes=True)

    def _read(self, pieces: Sequence[Piece], reader: ExpertReader, record: torch.Tensor) -> None:
        for piece in pieces:
            plane = self._planes[(piece.part, piece.role)]
            start = plane.offset + piece.rows[0] * plane.row_bytes
            end = plane.offset + piece.rows[1] * plane.row_bytes
            if end - start != piece.nbytes:
                raise ValueError(f"a {piece.part} {piece.role} piece of {piece.nbytes} bytes for {end - start}")
            reader.read_into(piece, _bytes_of(record[start:end]))

    def fill(self, slot: int, pieces: Sequence[Piece], reader: ExpertReader) -> None:
        """Read an expert's pieces from the checkpoint straight into its slot's planes (its scales checked)."""
        self._read(pieces, reader, self.record(slot))
        check_record(self.layout, self.record(slot), codes=False)
        self.bind(slot)

    def load(self, slot: int, read: Callable[[memoryview], None]) -> None:
        """Fill the slot with a record `read` writes (from the copy of the experts on disk)."""
        read(_bytes_of(self.record(slot)))
        self.bind(slot)

    def bind(self, slot: int) -> None:
        self._views[slot] = self.layout.views(self.record(slot))

    def views(self, slot: int) -> dict[str, torch.Tensor]:
        views = self._views[slot]
        assert views is not None, "a slot is computed only once filled"
        return views

    def project(self, module: Any, x: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
        """x: [n, H] rows sorted by slot_ids [n] -> the experts' outputs [n, H] float32 (before routing weights):
        one kernel call for every slot's gate_up, the activation over all rows, one for every slot's down."""
        slots, counts = torch.unique_consecutive(slot_ids, return_counts=True)
        return self.project_runs(module, x, slots.tolist(), counts.tolist())

    def project_runs(self, module: Any, x: torch.Tensor, slots: list[int], sizes: list[int]) -> torch.Tensor:
        """`project` with the rows' slots given as runs: sizes[i] rows for slots[i], in that order."""
        rows_in = x.float().contiguous()
        views = [self.views(slot) for slot in slots]
        spec = self.layout.spec
        shared = (self.kind, spec.group, spec.block)
        gate_up = torch.empty((x.shape[0], 2 * self.intermediate), dtype=torch.float32, device=x.device)
        grouped_matmul(
            rows_in,
            sizes,
            [(v["codes_gate_up"], v["scales_gate_up"]) for v in views],
            *shared,
            self.intermediate,
            gate_up,
        )
        hidden = module._apply_gate(gate_up).contiguous()
        out = torch.empty((x.shape[0], self.hidden), dtype=torch.float32, device=x.device)
        grouped_matmul(hidden, sizes, [(v["codes_down"], v["scales_down"]) for v in views], *shared, self.hidden, out)
        return out.to(x.dtype)


def check_record(layout: PackedLayout, record: torch.Tensor, *, codes: bool) -> None:
    """Refuse values the formats leave undefined: an E8M0 scale byte 255 (NaN in OCP MX), a scale that is not
    finite, and (with `codes`: a pass over every weight byte, done where an expert is read once, not per miss)
    an FP8 NaN code."""
    views = layout.views(record)
    for name in ("scales_gate_up", "scales_down"):
        scales = views[name]
        if layout.format == MXFP4 and bool((scales == 255).any()):
            raise UnsupportedQuantization(name, 255, "an E8M0 scale byte 255 is NaN in OCP MX")
        if layout.format != MXFP4 and not bool(torch.isfinite(scales).all()):
            raise UnsupportedQuantization(name, "nan/inf", "a scale that is not a finite number")
    if codes and layout.format == FP8:
        for name in ("codes_gate_up", "codes_down"):
            if bool(((views[name] & 0x7F) == 0x7F).any()):
                raise UnsupportedQuantization(name, "0x7F", "an FP8 e4m3fn NaN code in the weights")


def slots_class(quantize: str) -> type[FloatSlots] | type[Int8Slots]:
    """int8 slots for `placement.quantize=int8`; the model's dtype otherwise (int4 keeps experts in float)."""
    return Int8Slots if quantize == "int8" else FloatSlots
