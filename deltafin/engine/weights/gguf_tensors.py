"""The tensors of a GGUF file (name, type, shape, a memory-mapped view of the bytes) without parsing its metadata.

The `gguf` package's `GGUFReader` turns every metadata value into numpy views, the tokenizer's ~100k strings
included: 2-3 s of a server's start for SmolLM2 (and more for bigger vocabularies) that the native loader never
uses. This reader steps over metadata values by their lengths, keeps the two it needs (the architecture and the
data alignment) and maps tensors as `GGUFReader` does (same `data` shapes and dtypes, so `gguf.quants` takes them).
Layout: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (little-endian files, versions 2 and 3).
"""

from __future__ import annotations

import math
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


class DamagedGGUF(ValueError):
    """What is wrong with a GGUF file, in a sentence (read_tensors puts the file's path in front)."""


#: ggml's most dimensions a tensor has (GGML_MAX_DIMS)
MAX_DIMS = 4
#: the fewest bytes a metadata entry (key length, key, type, a one-byte value) and a tensor's description
#: (name length, dimension count, one dimension, type, offset) take: a count the rest of the file cannot hold
#: is damage, found before a loop runs through it
_MIN_ENTRY_BYTES, _MIN_TENSOR_INFO_BYTES = 13, 32
#: the fewest bytes an array element of a variable-size type takes (a string's length; an array's type and count)
_MIN_ELEMENT_BYTES = {_STRING: 8, _ARRAY: 12}


class _Cursor:
    """Reads the header, checking every length and count against what is left of the file."""

    def __init__(self, buffer: memoryview) -> None:
        self.buffer = buffer
        self.at = 0

    @property
    def left(self) -> int:
        return len(self.buffer) - self.at

    def need(self, size: int, what: str) -> None:
        if size > self.left:
            raise DamagedGGUF(
                f"{what} at byte {self.at} needs {size} bytes, more than the {self.left} left of its "
                f"{len(self.buffer)} (the file is cut short, or a length in it is wrong)"
            )

    def take(self, fmt: str, what: str) -> int:
        size = struct.calcsize(fmt)
        self.need(size, what)
        (value,) = struct.unpack_from(fmt, self.buffer, self.at)
        self.at += size
        return value

    def string(self, what: str) -> str:
        length = self.take("<Q", f"the length of {what}")
        self.need(length, what)
        start, self.at = self.at, self.at + length
        return bytes(self.buffer[start : self.at]).decode("utf-8", errors="replace")

    def skip_value(self, kind: int, what: str) -> None:
        if kind in _FIXED:
            self.need(_FIXED[kind], what)
            self.at += _FIXED[kind]
        elif kind == _STRING:
            length = self.take("<Q", f"the length of {what}")
            self.need(length, what)
            self.at += length
        elif kind == _ARRAY:
            element, count = self.take("<I", f"the element type of {what}"), self.take("<Q", f"the length of {what}")
            if element not in _FIXED and element not in _MIN_ELEMENT_BYTES:
                raise DamagedGGUF(f"{what} is an array of values of unknown type {element}")
            smallest = _FIXED.get(element) or _MIN_ELEMENT_BYTES[element]
            if count * smallest > self.left:
                raise DamagedGGUF(f"{what} is an array of {count} values, more than the {self.left} bytes left hold")
            if element in _FIXED:
                self.at += _FIXED[element] * count
            else:
                for _ in range(count):
                    self.skip_value(element, what)
        else:
            raise DamagedGGUF(f"{what} has unknown metadata type {kind}")


def read_tensors(path: Path) -> GGUFTensors:
    """The architecture and tensors of `path`; ValueError for a file that is not a little-endian GGUF v2/v3, or
    one cut short or damaged, with a sentence saying what is wrong (which length runs past the end, which tensor
    has an unknown type or does not fit), not a struct or numpy error."""
    try:
        return _read(path, np.memmap(path, mode="r"))
    except DamagedGGUF as exc:
        raise DamagedGGUF(f"{path}: a damaged or truncated GGUF file: {exc}") from None
    except (struct.error, TypeError, ZeroDivisionError, OverflowError) as exc:
        raise DamagedGGUF(f"{path}: a damaged or truncated GGUF file ({exc})") from None


def _read(path: Path, mapped: np.memmap) -> GGUFTensors:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    cursor = _Cursor(memoryview(mapped))  # type: ignore[arg-type]  # numpy arrays are buffers (numpy's stubs lag)
    if bytes(cursor.buffer[:4]) != MAGIC:
        raise ValueError(f"{path} is not a GGUF file")
    cursor.at = 4
    version = cursor.take("<I", "the version")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} (a big-endian file, or one this reader does not know)")
    tensor_count, kv_count = cursor.take("<Q", "the tensor count"), cursor.take("<Q", "the metadata count")
    if kv_count * _MIN_ENTRY_BYTES > cursor.left:
        raise DamagedGGUF(f"it declares {kv_count} metadata entries, more than its {len(cursor.buffer)} bytes hold")
    architecture, alignment = "?", 32
    for index in range(kv_count):
        key = cursor.string(f"metadata key {index}")
        kind = cursor.take("<I", f"the type of metadata {key!r}")
        if key == "general.architecture" and kind == _STRING:
            architecture = cursor.string(f"metadata {key!r}")
        elif key == "general.alignment" and kind == _UINT32:
            alignment = cursor.take("<I", f"metadata {key!r}")
            if alignment <= 0 or alignment & (alignment - 1):
                raise DamagedGGUF(f"general.alignment is {alignment}, not a power of two")
        else:
            cursor.skip_value(kind, f"metadata {key!r}")
    if tensor_count * _MIN_TENSOR_INFO_BYTES > cursor.left:
        raise DamagedGGUF(f"it declares {tensor_count} tensors, more than its {len(cursor.buffer)} bytes describe")
    infos = []
    for index in range(tensor_count):
        name = cursor.string(f"the name of tensor {index}")
        n_dims = cursor.take("<I", f"the dimension count of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise DamagedGGUF(f"tensor {name!r} has {n_dims} dimensions (a GGUF tensor has 1 to {MAX_DIMS})")
        dims = [cursor.take("<Q", f"a dimension of tensor {name!r}") for _ in range(n_dims)]
        infos.append((name, dims, cursor.take("<I", f"the type of tensor {name!r}"), cursor.take("<Q", "an offset")))
    start = cursor.at + (-cursor.at % alignment)
    known_types = {int(kind) for kind in GGMLQuantizationType}
    tensors, seen = [], set()
    for name, dims, raw_type, offset in infos:
        if name in seen:
            raise DamagedGGUF(f"tensor {name!r} is described twice")
        seen.add(name)
        if raw_type not in known_types or GGMLQuantizationType(raw_type) not in GGML_QUANT_SIZES:
            raise DamagedGGUF(f"tensor {name!r} has type {raw_type}, which is no ggml tensor type")
        kind = GGMLQuantizationType(raw_type)
        block, block_bytes = GGML_QUANT_SIZES[kind]
        if dims[0] % block:
            raise DamagedGGUF(f"tensor {name!r} has rows of {dims[0]} values, not whole {kind.name} blocks of {block}")
        elements = math.prod(dims)  # Python ints: a damaged dimension must not wrap around as numpy's would
        size = elements // block * block_bytes
        if start + offset + size > len(cursor.buffer):
            raise DamagedGGUF(
                f"tensor {name!r} ({kind.name}, {'x'.join(map(str, dims))}: {size} bytes at byte {start + offset}) "
                f"runs past the end of the file ({len(cursor.buffer)} bytes)"
            )
        shape = tuple(reversed(dims))
        if raw_type in _PLAIN:
            dtype, count = _PLAIN[raw_type], elements
        else:
            dtype, count, shape = np.uint8, size, quant_shape_to_byte_shape(shape, kind)
        view = np.ndarray((count,), dtype=dtype, buffer=mapped, offset=start + offset).reshape(shape)
        tensors.append(Tensor(name, kind, np.array(dims, dtype=np.uint64), view))
    return GGUFTensors(architecture, tensors)
