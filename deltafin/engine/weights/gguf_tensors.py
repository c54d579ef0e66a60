"""The tensors of a GGUF file (name, type, shape, a memory-mapped view of the bytes) without parsing its metadata.

The `gguf` package's `GGUFReader` turns every metadata value into numpy views, the tokenizer's ~100k strings
included: 2-3 s of a server's start for SmolLM2 (and more for bigger vocabularies) that the native loader never
uses. This reader steps over metadata values by their lengths, keeps the two it needs (the architecture and the
data alignment) and maps tensors as `GGUFReader` does (same `data` shapes and dtypes, so `gguf.quants` takes them).
Layout: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (little-endian files, versions 2 and 3).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
#: metadata value type -> its size in bytes (fixed-size types); 8 is a string, 9 an array
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
#: element types that map as themselves; every other ggml type maps as its bytes
_PLAIN = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


@dataclass(frozen=True)
class Tensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType (int-valued, with a .name)
    shape: np.ndarray  # GGUF's order: the innermost (row) width first
    data: np.ndarray  # numpy's order; a quantized type as uint8 rows of blocks


@dataclass(frozen=True)
class GGUFTensors:
    architecture: str
    tensors: list[Tensor]


class _Cursor:
    def __init__(self, buffer: memoryview) -> None:
        self.buffer = buffer
        self.at = 0

    def take(self, fmt: str) -> int:
        (value,) = struct.unpack_from(fmt, self.buffer, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.take("<Q")
        start, self.at = self.at, self.at + length
        return bytes(self.buffer[start : self.at]).decode("utf-8", errors="replace")

    def skip_value(self, kind: int) -> None:
        if kind in _FIXED:
            self.at += _FIXED[kind]
        elif kind == _STRING:
            length = self.take("<Q")  # (not `self.at += self.take(...)`: that reads `at` before take moves it)
            self.at += length
        elif kind == _ARRAY:
            element, count = self.take("<I"), self.take("<Q")
            if element in _FIXED:
                self.at += _FIXED[element] * count
            else:
                for _ in range(count):
                    self.skip_value(element)
        else:
            raise ValueError(f"unknown GGUF metadata type {kind} at byte {self.at}")


def read_tensors(path: Path) -> GGUFTensors:
    """The architecture and tensors of `path`; ValueError for a file that is not a little-endian GGUF v2/v3, or
    one cut short or damaged (a length or offset past its end), so the load fails with a sentence, not a
    struct error."""
    try:
        return _read(path, np.memmap(path, mode="r"))
    except (struct.error, TypeError, ZeroDivisionError, OverflowError) as exc:
        raise ValueError(f"{path}: a damaged or truncated GGUF file ({exc})") from None


def _read(path: Path, mapped: np.memmap) -> GGUFTensors:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    cursor = _Cursor(memoryview(mapped))  # type: ignore[arg-type]  # numpy arrays are buffers (numpy's stubs lag)
    if bytes(cursor.buffer[:4]) != MAGIC:
        raise ValueError(f"{path} is not a GGUF file")
    cursor.at = 4
    version = cursor.take("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} (a big-endian file, or one this reader does not know)")
    tensor_count, kv_count = cursor.take("<Q"), cursor.take("<Q")
    architecture, alignment = "?", 32
    for _ in range(kv_count):
        key, kind = cursor.string(), cursor.take("<I")
        if key == "general.architecture" and kind == _STRING:
            architecture = cursor.string()
        elif key == "general.alignment" and kind == _UINT32:
            alignment = cursor.take("<I")
        else:
            cursor.skip_value(kind)
    infos = []
    for _ in range(tensor_count):
        name, n_dims = cursor.string(), cursor.take("<I")
        dims = [cursor.take("<Q") for _ in range(n_dims)]
        infos.append((name, dims, cursor.take("<I"), cursor.take("<Q")))
    start = cursor.at + (-cursor.at % alignment)
    tensors = []
    for name, dims, raw_type, offset in infos:
        kind = GGMLQuantizationType(raw_type)
        elements = int(np.prod(dims))
        shape = tuple(reversed(dims))
        block, block_bytes = GGML_QUANT_SIZES[kind]
        if raw_type in _PLAIN:
            dtype, count = _PLAIN[raw_type], elements
        else:
            dtype, count, shape = np.uint8, elements * block_bytes // block, quant_shape_to_byte_shape(shape, kind)
        view = np.ndarray((count,), dtype=dtype, buffer=mapped, offset=start + offset).reshape(shape)
        tensors.append(Tensor(name, kind, np.array(dims, dtype=np.uint64), view))
    return GGUFTensors(architecture, tensors)
