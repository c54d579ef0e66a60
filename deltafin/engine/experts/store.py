"""Where a miss reads an expert from: the checkpoint itself, or a copy of its experts in the slots' records.

- `CheckpointSource`: the expert's byte ranges in the safetensors files, into the slot (float slots: straight
  in when the dtype is the served one; int8 slots: quantized on the way, `placement.experts.quantized_copy=false`;
  packed slots: each piece, codes and scales, straight into its plane: six reads an expert).
- `RecordCopy` (`placement.experts.quantized_copy`, the default): every routed expert written once, at the
  first boot, into one file in `model.cache_dir` (keyed on the checkpoint's identity and the record layout), one
  record per expert laid out exactly as a slot: the int8 slots' (`placement.quantize=int8`: quantized once, a
  quarter of the float32 bytes), or a published quantized checkpoint's packed records (the same bytes as the
  checkpoint's, gathered: lossless). A miss is then one read straight into the slot: no conversion, no copy.
  The file is opened with O_DIRECT where the filesystem allows it (`placement.experts.direct_io`): the read goes
  from the disk to the slot, with no page-cache copy to pay in CPU and no page cache to charge to a
  memory-capped process. A cache folder without room for the copy (the free space is checked first) serves from
  the checkpoint instead, with a warning.

A source's `fill(slots, slot, layer, expert)` runs on a reader thread; `nbytes(layer, expert)` is what it reads.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import structlog
import torch

from deltafin.engine.experts.checkpoint import ExpertIndex
from deltafin.engine.experts.reader import ExpertReader
from deltafin.engine.quant.formats import UnsupportedQuantization

log = structlog.get_logger("deltafin.engine")

#: bumped when a record's layout or quantization changes meaning (part of the file's key)
INT8_COPY_FORMAT = 1
PACKED_COPY_FORMAT = 1
#: free space a copy leaves on its filesystem
_HEADROOM = 1 << 30


class CheckpointSource:
    def __init__(self, index: ExpertIndex) -> None:
        self.index = index
        self.reader = ExpertReader(index.files)

    def fill(self, slots: Any, slot: int, layer: int, expert: int) -> None:
        slots.fill(slot, self.index.pieces[layer][expert], self.reader)

    def nbytes(self, layer: int, expert: int) -> int:
        return self.index.nbytes(layer, expert)

    def close(self) -> None:
        self.reader.close()


class RecordCopy:
    def __init__(self, path: Path, experts: int, stride: int, *, direct: bool) -> None:
        self.path, self.experts, self.stride = path, experts, stride
        self.direct = False
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self._fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                self.direct = True
            except OSError:  # a filesystem without direct I/O (tmpfs): through the page cache
                pass
        if not self.direct:
            self._fd = os.open(path, os.O_RDONLY)

    def fill(self, slots: Any, slot: int, layer: int, expert: int) -> None:
        slots.load(slot, lambda buffer: self._read(buffer, (layer * self.experts + expert) * self.stride))

    def _read(self, buffer: memoryview, offset: int) -> None:
        done = 0
        while done < self.stride:
            got = os.preadv(self._fd, [buffer[done:]], offset + done)
            if got <= 0:
                raise OSError(f"short read at byte {offset + done} of {self.path}")
            done += got

    def nbytes(self, layer: int, expert: int) -> int:
        return self.stride

    def close(self) -> None:
        os.close(self._fd)


def copy_path(folder: Path, index: ExpertIndex, slots: Any, cache_dir: Path) -> Path:
    from deltafin.engine.quant.quantize import FORMAT, source_key

    if slots.kind == "int8":
        version: tuple[object, ...] = ("int8-experts", INT8_COPY_FORMAT, FORMAT)
    else:
        spec = slots.layout.spec
        version = ("packed-experts", PACKED_COPY_FORMAT, spec.format, spec.group, spec.block, spec.scale_dtype)
    key = source_key(
        folder, *version, len(index.layers), index.experts, index.gate_up_shape, index.down_shape, slots.stride
    )
    return cache_dir / "experts" / f"{folder.name}-{slots.kind}-{key}.bin"


def open_record_copy(folder: Path, index: ExpertIndex, slots: Any, cache_dir: Path, *, direct: bool) -> RecordCopy:
    """The copy of the checkpoint's experts in `slots`' records, written first if this checkpoint has none yet
    (every expert read once into a record; a staging file renamed when whole). OSError where the cache folder
    cannot take it (read-only, or without room: checked before writing)."""
    path = copy_path(folder, index, slots, cache_dir)
    size = len(index.layers) * index.experts * slots.stride
    if not path.exists() or path.stat().st_size != size:
        _write_copy(path, index, slots, size)
    return RecordCopy(path, index.experts, slots.stride, direct=direct)


def _write_copy(path: Path, index: ExpertIndex, slots: Any, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(path.parent).free
    if free < size + _HEADROOM:
        raise OSError(
            f"{path.parent} has {free / (1 << 30):.1f} GiB free; the copy of the experts needs "
            f"{size / (1 << 30):.1f} GiB and 1 GiB to spare"
        )
    log.info(
        "expert_copy_start",
        path=str(path),
        format=slots.kind,
        experts=len(index.layers) * index.experts,
        mib=round(size / (1 << 20), 1),
    )
    started = time.perf_counter()
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    reader = ExpertReader(index.files)
    record = torch.zeros(slots.stride, dtype=torch.uint8)
    try:
        with staging.open("wb") as handle:
            for layer in range(len(index.layers)):
                for expert in range(index.experts):
                    try:
                        slots.encode(index.pieces[layer][expert], reader, record)
                    except UnsupportedQuantization as exc:  # a value the format leaves undefined: name the expert
                        raise exc.within(f"{index.layers[layer]} expert {expert}") from None
                    handle.write(record.numpy().data)
        staging.rename(path)  # a concurrent boot never reads half a file
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
    finally:
        reader.close()
    log.info("expert_copy_done", seconds=round(time.perf_counter() - started, 1))
