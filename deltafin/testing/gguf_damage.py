"""Damaged copies of a GGUF file, for the tests and the attack script that check what a load says about them.

`Layout` finds where each header field of a file lies (metadata entries, each tensor's name, dimension count,
dimensions, type and offset); `DAMAGE` names each way of damaging one field of the default model's file.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


@dataclass(frozen=True)
class TensorFields:
    name: str
    name_at: int  # the name's length field; the name follows it
    n_dims_at: int
    dims_at: int
    type_at: int
    offset_at: int


@dataclass(frozen=True)
class Layout:
    #: metadata key -> (where its key's length field is, where its type field is)
    metadata: dict[str, tuple[int, int]]
    tensors: dict[str, TensorFields]

    @classmethod
    def of(cls, data: bytes) -> Layout:
        at = 8
        tensor_count, kv_count = struct.unpack_from("<QQ", data, at)
        at += 16

        def skip(kind: int, at: int) -> int:
            if kind in _FIXED:
                return at + _FIXED[kind]
            if kind == 8:
                return at + 8 + struct.unpack_from("<Q", data, at)[0]
            element, count = struct.unpack_from("<IQ", data, at)
            at += 12
            if element in _FIXED:
                return at + _FIXED[element] * count
            for _ in range(count):
                at = skip(element, at)
            return at

        metadata = {}
        for _ in range(kv_count):
            (length,) = struct.unpack_from("<Q", data, at)
            key = data[at + 8 : at + 8 + length].decode()
            metadata[key] = (at, at + 8 + length)
            (kind,) = struct.unpack_from("<I", data, at + 8 + length)
            at = skip(kind, at + 12 + length)
        tensors = {}
        for _ in range(tensor_count):
            (length,) = struct.unpack_from("<Q", data, at)
            name = data[at + 8 : at + 8 + length].decode()
            n_dims_at = at + 8 + length
            (n_dims,) = struct.unpack_from("<I", data, n_dims_at)
            type_at = n_dims_at + 4 + 8 * n_dims
            tensors[name] = TensorFields(name, at, n_dims_at, n_dims_at + 4, type_at, type_at + 4)
            at = type_at + 12
        return cls(metadata, tensors)


def patched(data: bytes, at: int, fmt: str, value: int) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, at, value)
    return bytes(out)


def renamed(data: bytes, layout: Layout, name: str, new: str) -> bytes:
    """`name` spelled `new` (of the same length, so nothing else moves)."""
    assert len(new) == len(name)
    start = layout.tensors[name].name_at + 8
    return data[:start] + new.encode() + data[start + len(name) :]


Q = "blk.0.attn_q.weight"

#: a way of damaging the default model's file -> (the damage, words the load's error must contain)
DAMAGE: dict[str, tuple[Callable[[bytes, Layout], bytes], tuple[str, ...]]] = {
    "unknown tensor type": (
        lambda d, lay: patched(d, lay.tensors[Q].type_at, "<I", 99),
        (Q, "type 99, which is no ggml tensor type"),
    ),
    "tensor past the end": (
        lambda d, lay: patched(d, lay.tensors[Q].offset_at, "<Q", 10**12),
        (Q, "runs past the end of the file"),
    ),
    "row width not whole blocks": (
        lambda d, lay: patched(d, lay.tensors[Q].dims_at, "<Q", 577),
        (Q, "rows of 577 values, not whole Q4_1 blocks of 32"),
    ),
    "a dimension too large": (
        lambda d, lay: patched(d, lay.tensors[Q].dims_at + 8, "<Q", 2**62),
        (Q, "runs past the end of the file"),
    ),
    "too many dimensions": (
        lambda d, lay: patched(d, lay.tensors[Q].n_dims_at, "<I", 2**31),
        (Q, "2147483648 dimensions"),
    ),
    "too many tensors": (lambda d, lay: patched(d, 8, "<Q", 2**40), ("declares 1099511627776 tensors",)),
    "too many metadata entries": (
        lambda d, lay: patched(d, 16, "<Q", 2**40),
        ("declares 1099511627776 metadata entries",),
    ),
    "unknown metadata type": (
        lambda d, lay: patched(d, lay.metadata["general.name"][1], "<I", 99),
        ("'general.name'", "unknown metadata type 99"),
    ),
    "a string longer than the file": (
        lambda d, lay: patched(d, lay.metadata["general.architecture"][0], "<Q", 2**62),
        ("metadata key 0", "needs 4611686018427387904 bytes"),
    ),
    "a tensor described twice": (
        lambda d, lay: renamed(d, lay, "blk.0.attn_k.weight", Q),
        (Q, "described twice"),
    ),
}

#: damage only the model's load notices: the file reads, but is not the model its metadata describes
MODEL_DAMAGE: dict[str, tuple[Callable[[bytes, Layout], bytes], tuple[str, ...]]] = {
    "a layer's tensor missing": (
        lambda d, lay: renamed(d, lay, Q, "blk.0.attn_x.weight"),
        (Q, "has no tensor", "30 layers"),
    ),
    "a tensor's name without a dot": (
        lambda d, lay: renamed(d, lay, Q, "blk0attnqxweight000"),
        (Q, "has no tensor", "30 layers"),
    ),
    "a tensor of another shape": (
        lambda d, lay: patched(d, lay.tensors[Q].dims_at + 8, "<Q", 544),
        (Q, "is 576x544, its metadata makes it 576x576"),
    ),
}
