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
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

#: safetensors dtype names the pool reads (quantized checkpoints, e.g. FP8 blocks, are not readable as slices)
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
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
    rows: tuple[int, int]  # the rows of the expert's [rows, cols] matrix this range fills


@dataclass(frozen=True)
class TensorEntry:
    file: int
    offset: int
    nbytes: int
    dtype: torch.dtype | None  # None: a dtype the pool does not read
    shape: tuple[int, ...]


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
                number, start + begin, end - begin, _DTYPES.get(info["dtype"]), tuple(info["shape"])
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
    #: checkpoint keys that hold no routed expert: the dense weights
    dense_keys: list[str]

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
) -> ExpertIndex:
    """Map the checkpoint in `folder` onto `model` (a meta-device instance) whose experts modules are
    `experts` (name -> module); raises CheckpointLayoutError where an expert cannot be read as slices.
    `key_mapping` renames checkpoint keys first (as `from_pretrained(key_mapping=...)`: a multimodal
    checkpoint's prefix); keys starting with an `ignored` prefix (its other towers) are never read."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    files = checkpoint_files(folder)
    table = tensor_table(files)
    transforms = get_model_conversion_mapping(model, key_mapping=key_mapping)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    meta_state = model.state_dict()
    layers = list(experts)
    first = experts[layers[0]]
    count, gate_up_rows, hidden = first.gate_up_proj.shape
    down_shape = tuple(first.down_proj.shape[1:])
    for name, module in experts.items():
        if (
            tuple(module.gate_up_proj.shape) != (count, gate_up_rows, hidden)
            or tuple(module.down_proj.shape[1:]) != down_shape
        ):
            raise CheckpointLayoutError(
                f"{name}: experts of different shapes in one model are not supported by the pool"
            )
    found: list[list[list[Piece]]] = [[[] for _ in range(count)] for _ in layers]
    number_of = {name: i for i, name in enumerate(layers)}
    dense: list[str] = []
    for key, entry in table.items():
        if key.startswith(ignored) and ignored:
            continue
        target, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, meta_state)
        if target not in meta_state and key in meta_state:  # as from_pretrained: an exact name wins
            target, pattern = key, None
        module_name, _, part = target.rpartition(".")
        if module_name not in number_of or part not in PARTS:
            dense.append(key)
            continue
        if entry.dtype is None:
            raise CheckpointLayoutError(f"{key}: the expert pool reads float tensors (F32, BF16, F16), not this dtype")
        layer = number_of[module_name]
        for expert, piece in _pieces(key, entry, part, pattern, by_pattern, count, gate_up_rows, down_shape):
            found[layer][expert].append(piece)
    pieces = [
        [_complete(layers[i], e, found[i][e], gate_up_rows, down_shape[0]) for e in range(count)]
        for i in range(len(layers))
    ]
    return ExpertIndex(files, layers, count, (gate_up_rows, hidden), down_shape, pieces, dense)


def _pieces(
    key: str,
    entry: TensorEntry,
    part: str,
    pattern: str | None,
    by_pattern: dict[str, Any],
    count: int,
    gate_up_rows: int,
    down_shape: tuple[int, int],
) -> Iterable[tuple[int, Piece]]:
    rows_total = gate_up_rows if part == "gate_up_proj" else down_shape[0]
    dtype = entry.dtype
    assert dtype is not None  # build_index refused the others
    if pattern is None:  # stored fused: slice [e] of [E, rows, cols]
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
    rows = entry.shape[0]
    at = converter.source_patterns.index(pattern) * rows  # Concatenate(dim=1) joins the sources in pattern order
    if len(entry.shape) != 2 or at + rows > rows_total:
        raise CheckpointLayoutError(f"{key}: shape {list(entry.shape)} does not fit {part}'s {rows_total} rows")
    yield int(number.group(1)), Piece(entry.file, entry.offset, entry.nbytes, dtype, part, (at, at + rows))


def _complete(layer: str, expert: int, pieces: list[Piece], gate_up_rows: int, down_rows: int) -> tuple[Piece, ...]:
    """The expert's pieces, checked to cover both matrices exactly once, in one dtype."""
    for part, rows in (("gate_up_proj", gate_up_rows), ("down_proj", down_rows)):
        spans = sorted(piece.rows for piece in pieces if piece.part == part)
        covered = 0
        for start, end in spans:
            if start != covered:
                break
            covered = end
        if covered != rows:
            raise CheckpointLayoutError(f"{layer}: the checkpoint lacks rows of expert {expert}'s {part}")
    if len({piece.dtype for piece in pieces}) != 1:
        raise CheckpointLayoutError(f"{layer}: expert {expert} is stored in several dtypes")
    return tuple(sorted(pieces, key=lambda piece: (piece.file, piece.offset)))
