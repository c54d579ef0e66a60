"""Where each routed expert's weights lie in the checkpoint's safetensors files, as byte ranges.

A pooled model keeps an experts module's fused parameters (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I])
out of memory; a miss reads expert e's rows of both from the files. Checkpoints store them in one of two ways:

- per expert (every checkpoint on the Hub, and what transformers 5 writes back with `save_pretrained`):
  `...experts.{e}.gate_proj.weight` / `up_proj` / `down_proj` (DeepseekV3, GLM, Qwen3-MoE) or
  `...block_sparse_moe.experts.{e}.w1` / `w3` / `w2` (Mixtral, Kimi Linear): three tensors, each one range;
- fused (a model saved without reverting the conversion): `...experts.gate_up_proj` [E, 2I, H], whose slice
  [e] is one range.

Which file key lands on which parameter, and in what order gate and up are concatenated, is decided by
transformers' own conversion mapping (`get_model_conversion_mapping` + `rename_source_key`, what
`from_pretrained` runs), not by a table here: one reading for every architecture transformers converts.

A published quantized checkpoint (`deltafin.engine.quant.formats`) stores each expert projection as codes and
scales (`...gate_proj.weight_packed` + `.weight_scale`, or FP8 `.weight` + `.weight_scale_inv`): each is read
as a piece with its role, placed by the same mapping (the key's module with `.weight` is what is renamed), its
rows those of the projection (the codes, a 4-bit format's scales) or of its block grid (FP8 scales).
A multimodal checkpoint's language model is read under its key renaming (`language_model.` dropped, as
`from_pretrained(key_mapping=...)`); the other towers' keys are left out.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from deltafin.engine.quant.formats import Header, PackedModule, PublishedFormat, find_packed

#: safetensors float dtype names the float pool reads and converts
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
#: every dtype a piece may have (a packed format's codes and scales are read as they are stored)
STORED = {**_DTYPES, "U8": torch.uint8, "I32": torch.int32, "I64": torch.int64, "F8_E4M3": torch.float8_e4m3fn}
#: the expert number in a per-expert key (`...experts.17.w1.weight`)
_EXPERT_NUMBER = re.compile(r"(?:^|\.)experts\.(\d+)\.")
PARTS = ("gate_up_proj", "down_proj")


class CheckpointLayoutError(ValueError):
    """The checkpoint's experts cannot be read as slices (the message says which key and why)."""


@dataclass(frozen=True)
class Piece:
    """One contiguous byte range of a checkpoint file holding rows `rows` of an expert's `part`."""

    file: int  # index into ExpertIndex.files
    offset: int  # absolute offset in the file
    nbytes: int
    dtype: torch.dtype
    part: str  # gate_up_proj | down_proj
    rows: tuple[int, int]  # the rows of the expert's [rows, cols] matrix (or, for scales, plane) it fills
    role: str = "weight"  # weight (float) | codes | scales (a packed format's planes)


@dataclass(frozen=True)
class TensorEntry:
    file: int
    offset: int
    nbytes: int
    dtype: torch.dtype | None  # None: not a float dtype
    shape: tuple[int, ...]
    stored: str = ""  # the safetensors dtype name


def read_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file, with data offsets made absolute (`__data_start__`)."""
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    header["__data_start__"] = 8 + length
    return header


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a model folder (the index's shards, or every *.safetensors file)."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / name for name in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointLayoutError(f"{folder} holds no .safetensors files (the expert pool reads safetensors)")
    return files


def tensor_table(files: list[Path]) -> dict[str, TensorEntry]:
    """Every tensor of the checkpoint: its file, byte range, dtype and shape."""
    table: dict[str, TensorEntry] = {}
    for number, path in enumerate(files):
        header = read_header(path)
        start = header.pop("__data_start__")
        header.pop("__metadata__", None)
        for name, info in header.items():
            begin, end = info["data_offsets"]
            table[name] = TensorEntry(
                number, start + begin, end - begin, _DTYPES.get(info["dtype"]), tuple(info["shape"]), info["dtype"]
            )
    return table


@dataclass
class ExpertIndex:
    """For every experts module (a "layer" here, numbered in model order) and expert: the pieces to read."""

    files: list[Path]
    layers: list[str]  # experts module names, in model order
    experts: int  # E, the routed experts of each layer
    gate_up_shape: tuple[int, int]  # [2I, H]
    down_shape: tuple[int, int]  # [H, I]
    pieces: list[list[tuple[Piece, ...]]]  # [layer][expert]
    #: checkpoint keys that hold no routed expert: the dense weights (float, to transformers' loader)
    dense_keys: list[str]
    #: a published quantized checkpoint's expert projections: the format of one (all alike), else None
    packed: PackedModule | None = None
    #: quantized dense modules: the model's module name -> its tensors in the checkpoint
    dense_packed: dict[str, PackedModule] = field(default_factory=dict)
    #: (layer, its first expert's `weight_shape` keys): checked once at load
    shape_checks: list[tuple[PackedModule, TensorEntry]] = field(default_factory=list)
    #: the checkpoint's tensors (a multimodal checkpoint's other towers left out)
    table: dict[str, TensorEntry] = field(default_factory=dict)

    def nbytes(self, layer: int, expert: int) -> int:
        return sum(piece.nbytes for piece in self.pieces[layer][expert])

    @property
    def total_bytes(self) -> int:
        return sum(piece.nbytes for layer in self.pieces for expert in layer for piece in expert)

    @property
    def file_dtype(self) -> torch.dtype:
        return self.pieces[0][0][0].dtype


def build_index(
    folder: Path,
    model: Any,
    experts: dict[str, Any],
    *,
    key_mapping: dict[str, str] | None = None,
    ignored: tuple[str, ...] = (),
    published: PublishedFormat | None = None,
) -> ExpertIndex:
    """Map the checkpoint in `folder` onto `model` (a meta-device instance) whose experts modules are
    `experts` (name -> module, possibly none); raises CheckpointLayoutError where an expert cannot be read as
    slices, UnsupportedQuantization where a `published` checkpoint's tensors do not fit its format.
    `key_mapping` renames checkpoint keys first (as `from_pretrained(key_mapping=...)`: a multimodal
    checkpoint's prefix); keys starting with an `ignored` prefix (its other towers) are never read."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    files = checkpoint_files(folder)
    table = {key: entry for key, entry in tensor_table(files).items() if not (ignored and key.startswith(ignored))}
    packed = find_packed({k: Header(e.stored, e.shape) for k, e in table.items()}, published) if published else {}
    role_of = {key: (module, role) for module, spec in packed.items() for role, key in spec.keys.items()}
    transforms = get_model_conversion_mapping(model, key_mapping=key_mapping)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    meta_state = model.state_dict()

    def target_of(key: str) -> tuple[str, str | None]:
        target, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, meta_state)
        if target not in meta_state and key in meta_state:  # as from_pretrained: an exact name wins
            target, pattern = key, None
        return target, pattern

    layers = list(experts)
    if layers:
        first = experts[layers[0]]
        count, gate_up_rows, hidden = first.gate_up_proj.shape
        down_shape = tuple(first.down_proj.shape[1:])
    else:
        count, gate_up_rows, hidden, down_shape = 0, 0, 0, (0, 0)
    for name, module in experts.items():
        if (
            tuple(module.gate_up_proj.shape) != (count, gate_up_rows, hidden)
            or tuple(module.down_proj.shape[1:]) != down_shape
        ):
            raise CheckpointLayoutError(
                f"{name}: experts of different shapes in one model are not supported by the pool"
            )
    shape = _Shape(count, gate_up_rows, down_shape)
    found: list[list[list[Piece]]] = [[[] for _ in range(count)] for _ in layers]
    number_of = {name: i for i, name in enumerate(layers)}
    dense: list[str] = []
    index = ExpertIndex(files, layers, int(count), (gate_up_rows, hidden), down_shape, [], dense, table=table)
    expert_specs: dict[tuple[int, int], PackedModule] = {}
    for key, entry in table.items():
        module_name, role = role_of.get(key, (None, "weight"))
        target, pattern = target_of(key if module_name is None else f"{module_name}.weight")
        experts_name, _, part = target.rpartition(".")
        if experts_name not in number_of or part not in PARTS:
            if module_name is None:
                dense.append(key)
            elif role == "codes":  # one entry per quantized dense module, under the model's name of it
                index.dense_packed[target.removesuffix(".weight")] = packed[module_name]
            continue
        if module_name is None and entry.dtype is None:
            raise CheckpointLayoutError(f"{key}: the expert pool reads float tensors (F32, BF16, F16), not this dtype")
        layer = number_of[experts_name]
        spec = packed.get(module_name) if module_name else None
        for expert, piece in _pieces(key, entry, part, pattern, by_pattern, shape, spec, role):
            if spec is not None:
                expert_specs[(layer, expert)] = spec
                if role == "shape":
                    if expert == 0:
                        index.shape_checks.append((spec, entry))
                    continue
            found[layer][expert].append(piece)
    if expert_specs:
        index.packed = _one_format(expert_specs, shape)
    index.pieces = [
        [_complete(layers[i], e, found[i][e], gate_up_rows, down_shape[0], index.packed) for e in range(count)]
        for i in range(len(layers))
    ]
    return index


@dataclass(frozen=True)
class _Shape:
    experts: int
    gate_up_rows: int
    down_shape: tuple[int, int]


def _one_format(specs: dict[tuple[int, int], PackedModule], shape: _Shape) -> PackedModule:
    """The experts' projections are all in one format, group and scale dtype, of the model's shapes."""
    first = next(iter(specs.values()))
    intermediate, hidden = shape.gate_up_rows // 2, shape.down_shape[0]
    for spec in specs.values():
        if (spec.format, spec.group, spec.block, spec.scale_dtype) != (
            first.format,
            first.group,
            first.block,
            first.scale_dtype,
        ):
            raise CheckpointLayoutError(
                f"{spec.module}: experts stored in several formats ({spec.format} groups of {spec.group}, "
                f"{spec.scale_dtype} scales, against {first.format} groups of {first.group}, {first.scale_dtype})"
            )
        down = spec.in_features == intermediate and spec.out_features == hidden
        gate_or_up = spec.in_features == hidden and spec.out_features == intermediate
        if not (down or gate_or_up):
            raise CheckpointLayoutError(
                f"{spec.module}: a quantized projection of [{spec.out_features}, {spec.in_features}] in experts "
                f"of hidden {hidden} and intermediate {intermediate}"
            )
    return first


def _pieces(
    key: str,
    entry: TensorEntry,
    part: str,
    pattern: str | None,
    by_pattern: dict[str, Any],
    shape: _Shape,
    spec: PackedModule | None,
    role: str,
) -> Iterable[tuple[int, Piece]]:
    count = shape.experts
    rows_total = shape.gate_up_rows if part == "gate_up_proj" else shape.down_shape[0]
    dtype = entry.dtype if spec is None else STORED[entry.stored]
    assert dtype is not None  # build_index refused the others
    if pattern is None:  # stored fused: slice [e] of [E, rows, cols]
        if spec is not None:
            raise CheckpointLayoutError(f"{key}: fused quantized expert tensors are not served by the pool")
        if len(entry.shape) != 3 or entry.shape[0] != count or entry.shape[1] != rows_total:
            raise CheckpointLayoutError(f"{key}: shape {list(entry.shape)} is not [{count}, {rows_total}, ...]")
        per = entry.nbytes // count
        for expert in range(count):
            yield expert, Piece(entry.file, entry.offset + expert * per, per, dtype, part, (0, rows_total))
        return
    converter = by_pattern[pattern]
    operations = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
    expected = [("MergeModulelist", 0)] + ([("Concatenate", 1)] if len(converter.source_patterns) > 1 else [])
    if operations != expected:
        raise CheckpointLayoutError(f"{key}: experts converted by {operations} cannot be read as slices")
    number = _EXPERT_NUMBER.search(key)
    if number is None or not 0 <= int(number.group(1)) < count:
        raise CheckpointLayoutError(f"{key}: no expert number in 0..{count - 1} in the key")
    position = converter.source_patterns.index(pattern)  # Concatenate(dim=1) joins the sources in pattern order
    if spec is None:
        rows, total = entry.shape[0], rows_total
        if len(entry.shape) != 2:
            raise CheckpointLayoutError(f"{key}: shape {list(entry.shape)} does not fit {part}'s {rows_total} rows")
    elif role == "scales" and spec.block != (0, 0):  # FP8: each part keeps its own block grid
        rows = spec.scale_shape[0]
        total = rows * len(converter.source_patterns)
    else:
        rows, total = spec.out_features, rows_total
    at = position * rows
    if at + rows > total or (spec is not None and spec.out_features * len(converter.source_patterns) != rows_total):
        raise CheckpointLayoutError(f"{key}: shape {list(entry.shape)} does not fit {part}'s {rows_total} rows")
    yield int(number.group(1)), Piece(entry.file, entry.offset, entry.nbytes, dtype, part, (at, at + rows), role)


def _complete(
    layer: str, expert: int, pieces: list[Piece], gate_up_rows: int, down_rows: int, packed: PackedModule | None
) -> tuple[Piece, ...]:
    """The expert's pieces, checked to cover both matrices exactly once (a packed expert: its codes and its
    scales), in one dtype per role."""
    roles = ("weight",) if packed is None else ("codes", "scales")
    for role in roles:
        for part, rows in (("gate_up_proj", gate_up_rows), ("down_proj", down_rows)):
            if role == "scales" and packed is not None and packed.block != (0, 0):
                rows = -(-rows // packed.block[0]) if part == "down_proj" else 2 * -(-rows // 2 // packed.block[0])
            spans = sorted(piece.rows for piece in pieces if piece.part == part and piece.role == role)
            covered = 0
            for start, end in spans:
                if start != covered:
                    break
                covered = end
            if covered != rows:
                what = part if role == "weight" else f"{part} ({role})"
                raise CheckpointLayoutError(f"{layer}: the checkpoint lacks rows of expert {expert}'s {what}")
    for role in roles:
        if len({piece.dtype for piece in pieces if piece.role == role}) != 1:
            raise CheckpointLayoutError(f"{layer}: expert {expert} is stored in several dtypes")
    return tuple(sorted(pieces, key=lambda piece: (piece.file, piece.offset)))
