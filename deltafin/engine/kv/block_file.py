"""One block of a cached prefix on disk: a safetensors file (any safetensors reader opens it) whose metadata
names what it is and carries a checksum of its tensor bytes.

    8 bytes   little-endian length N of the header
    N bytes   JSON header: {tensor name: {dtype, shape, data_offsets}, "__metadata__": {str: str}}
    ...       the tensors' bytes, in header order

Metadata: `format` (this layout's name and version), `namespace` (the model, weights format, dtype and template
the positions were computed with), `parent` (the chain hash of the blocks before it), `tokens` (the block's token
ids), `crc32` (of everything after the header). A file whose header, checksum, namespace, parent or tokens
disagree with what the reader expects is damaged or foreign: `read_block` raises `BadBlock` and the caller
removes it. Tensors are read and written as numpy arrays (no torch op runs on the I/O threads: a torch op there
would grow an OpenMP team beside the engine's, which slows its steps), bfloat16 as its raw 16-bit words.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

FORMAT = "deltafin-kv-block/1"
#: a header larger than this is not one this module wrote (a block's header is a few KiB)
MAX_HEADER = 16 << 20

#: safetensors dtype name -> (torch dtype, numpy dtype of the stored words)
DTYPES: dict[str, tuple[torch.dtype, Any]] = {
    "F32": (torch.float32, np.float32),
    "F16": (torch.float16, np.float16),
    "BF16": (torch.bfloat16, np.uint16),
    "F64": (torch.float64, np.float64),
}
_NAMES = {torch_dtype: name for name, (torch_dtype, _) in DTYPES.items()}


class BadBlock(Exception):
    """The file is not a sound block of the expected prefix (truncated, damaged, foreign)."""


def as_array(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's numpy view (bfloat16 as its 16-bit words): no copy."""
    if tensor.dtype not in _NAMES:
        raise TypeError(f"no block dtype for {tensor.dtype}")
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()


def dtype_name(dtype: torch.dtype) -> str:
    return _NAMES[dtype]


def encode_block(tensors: Mapping[str, tuple[str, np.ndarray]], metadata: Mapping[str, str]) -> list[Any]:
    """The file's pieces, in order (header, then each tensor's bytes): `tensors` maps a name to (safetensors
    dtype, array); arrays are made contiguous here (a slice of positions of a cache is not)."""
    arrays = {name: (dtype, np.ascontiguousarray(array)) for name, (dtype, array) in tensors.items()}
    header: dict[str, Any] = {}
    offset = 0
    crc = 0
    for name, (dtype, array) in arrays.items():
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
        crc = zlib.crc32(array.data.cast("B"), crc)
    header["__metadata__"] = {**metadata, "format": FORMAT, "crc32": str(crc)}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors aligns the data to 8 bytes
    return [struct.pack("<Q", len(text)), text, *(array.data.cast("B") for _, array in arrays.values())]


def read_block(
    data: bytes | bytearray | memoryview, expect: Mapping[str, str]
) -> dict[str, tuple[torch.dtype, np.ndarray]]:
    """The tensors of a block file's bytes as (torch dtype, numpy view into `data`; bfloat16 as its 16-bit
    words), after checking its header, its checksum and that every metadata key of `expect` has the expected
    value; raises BadBlock otherwise."""
    view = memoryview(data)
    if len(view) < 8:
        raise BadBlock("shorter than a header")
    (size,) = struct.unpack("<Q", view[:8])
    if size > MAX_HEADER or 8 + size > len(view):
        raise BadBlock("header length out of range (truncated?)")
    try:
        header = json.loads(bytes(view[8 : 8 + size]))
        metadata = header.pop("__metadata__")
    except (ValueError, KeyError, TypeError) as exc:
        raise BadBlock(f"unreadable header ({exc})") from None
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise BadBlock("not a block of this format")
    for key, value in expect.items():
        if metadata.get(key) != value:
            raise BadBlock(f"{key} differs (a foreign block)")
    body = view[8 + size :]
    if str(zlib.crc32(body)) != metadata.get("crc32"):
        raise BadBlock("checksum mismatch (damaged or truncated)")
    out: dict[str, tuple[torch.dtype, np.ndarray]] = {}
    try:
        for name, spec in header.items():
            dtype, stored = DTYPES[spec["dtype"]]
            start, end = spec["data_offsets"]
            shape = tuple(int(n) for n in spec["shape"])
            if not 0 <= start <= end <= len(body):
                raise BadBlock(f"{name}: data outside the file")
            array = np.frombuffer(body[start:end], dtype=stored)
            out[name] = (dtype, array.reshape(shape))
    except (KeyError, ValueError, TypeError) as exc:
        raise BadBlock(f"bad tensor entry ({exc})") from None
    return out


def metadata_of(data: bytes | bytearray | memoryview) -> dict[str, str]:
    """The metadata of a block file's bytes (no checks beyond the header's shape)."""
    view = memoryview(data)
    (size,) = struct.unpack("<Q", view[:8])
    return json.loads(bytes(view[8 : 8 + size]))["__metadata__"]
