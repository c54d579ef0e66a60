"""Which modules of a checkpoint are stored quantized, read from its safetensors headers, and their tensors.

Per quantized module M (a Linear, weight [N, K] = [out, in]):

| format | tensors | dtype, shape |
|---|---|---|
| int4 | `M.weight_packed`, `M.weight_scale`, `M.weight_shape` | I32 [N, K/8]; BF16, F16 or F32 [N, K/G]; I64 [2] = [N, K] |
| mxfp4 | `M.weight_packed`, `M.weight_scale` | U8 [N, K/2]; U8 [N, K/32] |
| fp8 | `M.weight`, `M.weight_scale_inv` | F8_E4M3 [N, K]; F32 [ceil(N/bn), ceil(K/bk)] |

int4's int32 words, viewed as little-endian bytes, are codes two per byte with element 2j in the low nibble of
byte j: MXFP4's order. Both 4-bit formats are therefore held as the same code plane, U8 [N, K/2], the
checkpoint's bytes as they are. Everything is decided from the headers (names, dtypes, shapes), never by
reading the weights; a module whose tensors do not fit its format refuses with one line naming the tensor.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from deltafin.engine.quant.formats.config import FP8, INT4, MXFP4, PublishedFormat, UnsupportedQuantization

#: the role of each tensor of a quantized module, by name suffix (fp8 codes are `.weight` of dtype F8_E4M3)
SUFFIXES = {"weight_packed": "codes", "weight_scale": "scales", "weight_shape": "shape", "weight_scale_inv": "scales"}
#: tensors of schemes Deltafin does not serve (asymmetric, activation-ordered, NVFP4, static activations)
REFUSED = {
    "weight_zero_point": "asymmetric weights (zero points) are not served",
    "weight_g_idx": "activation-ordered groups (g_idx) are not served",
    "weight_global_scale": "two-level scales (NVFP4) are not served",
    "input_global_scale": "quantized activations are not served",
    "input_scale": "static activation scales are not served",
}
_SCALE_DTYPES = {INT4: ("BF16", "F16", "F32"), MXFP4: ("U8",), FP8: ("F32",)}
_ITEM = {"BF16": 2, "F16": 2, "F32": 4, "U8": 1, "I32": 4, "I64": 8, "F8_E4M3": 1}


@dataclass(frozen=True)
class Header:
    """One tensor as its safetensors header gives it."""

    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class PackedModule:
    """A quantized Linear of the checkpoint: its format, logical shape and tensors (role -> checkpoint key)."""

    module: str  # the checkpoint's name of the module (a key without its suffix)
    format: str  # int4 | mxfp4 | fp8
    out_features: int  # N
    in_features: int  # K
    keys: dict[str, str] = field(hash=False)  # codes, scales (, shape)
    scale_dtype: str  # safetensors dtype of the scales
    group: int = 0  # 4-bit: values per scale
    block: tuple[int, int] = (0, 0)  # fp8: block rows, block columns

    @property
    def code_bytes(self) -> int:
        """Bytes of one row of codes."""
        return self.in_features if self.format == FP8 else self.in_features // 2

    @property
    def scale_shape(self) -> tuple[int, int]:
        if self.format == FP8:
            return (-(-self.out_features // self.block[0]), -(-self.in_features // self.block[1]))
        return (self.out_features, self.in_features // self.group)

    @property
    def scale_item(self) -> int:
        return _ITEM[self.scale_dtype]

    @property
    def nbytes(self) -> int:
        """Bytes of codes and scales (what serving the module holds)."""
        return self.out_features * self.code_bytes + math.prod(self.scale_shape) * self.scale_item


def split_key(key: str) -> tuple[str, str]:
    """`a.b.weight_packed` -> (`a.b`, `weight_packed`)."""
    module, _, suffix = key.rpartition(".")
    return module, suffix


def find_packed(table: Mapping[str, Header], fmt: PublishedFormat) -> dict[str, PackedModule]:
    """module name -> its quantized tensors, for every module of `table` (checkpoint key -> header) stored in
    `fmt`; UnsupportedQuantization naming the tensor where one does not fit."""
    roles: dict[str, dict[str, str]] = {}
    for key, header in table.items():
        module, suffix = split_key(key)
        if suffix in REFUSED:
            raise UnsupportedQuantization(key, list(header.shape), REFUSED[suffix])
        if header.dtype.startswith("F8_") and not (
            fmt.name == FP8 and suffix == "weight" and header.dtype == "F8_E4M3"
        ):
            raise UnsupportedQuantization(key, header.dtype, f"an FP8 tensor in a {fmt.title} checkpoint")
        if fmt.name == FP8:
            role = "codes" if suffix == "weight" and header.dtype == "F8_E4M3" else None
            role = "scales" if suffix == "weight_scale_inv" else role
            stray = suffix in SUFFIXES and role is None
        else:
            role = SUFFIXES.get(suffix) if suffix != "weight_scale_inv" else None
            stray = suffix == "weight_scale_inv"
        if stray:
            raise UnsupportedQuantization(key, list(header.shape), f"not a tensor of a {fmt.title} checkpoint")
        if role is not None:
            found = roles.setdefault(module, {})
            found[role] = key
    modules = {}
    for module, keys in roles.items():
        if "codes" not in keys:
            first = next(iter(keys.values()))
            raise UnsupportedQuantization(first, list(table[first].shape), f"has no {_codes_name(fmt)} beside it")
        modules[module] = _module(module, keys, table, fmt)
    return modules


def _codes_name(fmt: PublishedFormat) -> str:
    return "F8_E4M3 weight" if fmt.name == FP8 else "weight_packed"


def _module(module: str, keys: dict[str, str], table: Mapping[str, Header], fmt: PublishedFormat) -> PackedModule:
    codes = table[keys["codes"]]
    if "scales" not in keys:
        scale = "weight_scale_inv" if fmt.name == FP8 else "weight_scale"
        raise UnsupportedQuantization(keys["codes"], list(codes.shape), f"has no {module}.{scale} beside it")
    scales = table[keys["scales"]]
    if len(codes.shape) != 2:
        raise UnsupportedQuantization(
            keys["codes"], list(codes.shape), "only 2-D (one per module and expert) quantized tensors are served"
        )
    if scales.dtype not in _SCALE_DTYPES[fmt.name]:
        raise UnsupportedQuantization(
            keys["scales"], scales.dtype, f"{fmt.title} scales are {' or '.join(_SCALE_DTYPES[fmt.name])}"
        )
    if fmt.name != FP8 and fmt.ignored(module):
        raise UnsupportedQuantization(
            keys["codes"],
            list(codes.shape),
            f"the config's ignore list names this module, yet it is stored as {fmt.name}",
        )
    rows, cols = codes.shape
    if fmt.name == FP8:
        bn, bk = fmt.block or (128, 128)
        packed = PackedModule(module, FP8, rows, cols, keys, scales.dtype, block=(bn, bk))
        if tuple(scales.shape) != packed.scale_shape:
            raise UnsupportedQuantization(
                keys["scales"],
                list(scales.shape),
                f"is not the [{packed.scale_shape[0]}, {packed.scale_shape[1]}] grid of {bn}x{bk} blocks "
                f"over [{rows}, {cols}]",
            )
        return packed
    expected = "I32" if fmt.name == INT4 else "U8"
    if codes.dtype != expected:
        raise UnsupportedQuantization(keys["codes"], codes.dtype, f"{fmt.title} codes are {expected}")
    width = cols * (8 if fmt.name == INT4 else 2)
    if "shape" in keys:
        shape = table[keys["shape"]]
        if shape.dtype not in ("I64", "I32") or tuple(shape.shape) != (2,):
            raise UnsupportedQuantization(keys["shape"], list(shape.shape), "weight_shape is [out, in] (I64 [2])")
    if len(scales.shape) != 2 or scales.shape[0] != rows or scales.shape[1] <= 0 or width % scales.shape[1]:
        raise UnsupportedQuantization(
            keys["scales"], list(scales.shape), f"is not [{rows}, {width} / group size] for codes {list(codes.shape)}"
        )
    group = width // scales.shape[1]
    if width % 32 or group % 16:
        raise UnsupportedQuantization(
            keys["codes"],
            list(codes.shape),
            f"a width of {width} in groups of {group}: widths in multiples of 32 and groups of a multiple of 16 are served",
        )
    allowed = fmt.group_sizes(module)
    if not allowed:
        raise UnsupportedQuantization(
            keys["codes"], list(codes.shape), "no config group targets this module, yet it is stored quantized"
        )
    if group not in allowed:
        raise UnsupportedQuantization(
            keys["scales"],
            list(scales.shape),
            f"groups of {group} values, but the config groups targeting this module say {sorted(allowed)}",
        )
    return PackedModule(module, fmt.name, rows, width, keys, scales.dtype, group=group)


def check_shape(module: PackedModule, value: Any) -> None:
    """A `weight_shape` tensor's value against the module's shape (read where it is cheap: the dense modules
    and one expert per layer)."""
    got = [int(v) for v in value]
    if got != [module.out_features, module.in_features]:
        raise UnsupportedQuantization(
            module.keys["shape"],
            got,
            f"the codes hold [{module.out_features}, {module.in_features}] (padded widths are not served)",
        )
