"""Weight-only quantization of a model's linear layers at load (`placement.quantize`: none | int8 | int4).

int8: one scale per output channel; int4: groups of `INT4_GROUP` input channels with a scale and a zero each.
The modules and their kernels are in `deltafin.engine.quant.linear`. The quantized tensors are cached as safetensors in the cache
folder (keyed on the source folder's weights and the mode), so later boots skip the quantization.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import structlog
import torch
from torch import nn

from deltafin.engine.quant.linear import COMPUTE, INT4_GROUP, INT4_INNER_K_TILES, Int4Linear, Int8Linear

log = structlog.get_logger("deltafin.engine")

MODES = ("none", "int8", "int4")
#: bumped when the cached tensors change meaning (v2: int8 scales are float32)
FORMAT = 2


def supported(mode: str, device: torch.device) -> str | None:
    """Why `mode` cannot run here, or None."""
    if mode not in MODES:
        return f"placement.quantize must be one of {', '.join(MODES)}, not {mode!r}"
    if mode == "none":
        return None
    if device.type != "cpu":
        return f"placement.quantize={mode} has CPU kernels only (device {device.type})"
    op = "_weight_int8pack_mm" if mode == "int8" else "_weight_int4pack_mm_for_cpu"
    if not hasattr(torch.ops.aten, op):
        return f"placement.quantize={mode}: this torch has no {op}"
    return None


def _targets(model: nn.Module, mode: str) -> dict[str, nn.Linear]:
    """Every linear layer (the LM head included: it is a sixth of a small model's weights)."""
    found = {}
    for name, module in model.named_modules():
        if type(module) is nn.Linear:
            if mode == "int4" and module.in_features % INT4_GROUP:
                continue  # the int4 kernel needs whole groups; such a layer stays float
            found[name] = module
    return found


def source_key(source: Path, *parts: object) -> str:
    """A short digest of a checkpoint folder's identity (its safetensors files' names, sizes and times) and
    `parts` (what a cached derivative depends on besides the weights): the key of a cache file."""
    digest = hashlib.sha256(":".join(str(part) for part in parts).encode())
    for file in sorted(source.glob("*.safetensors")):
        stat = file.stat()
        digest.update(f"{file.name}:{stat.st_size}:{int(stat.st_mtime)}".encode())
    return digest.hexdigest()[:12]


def _cache_file(source: Path, mode: str, cache_dir: Path) -> Path:
    key = source_key(source, mode, INT4_GROUP, COMPUTE, FORMAT)
    return cache_dir / "quantized" / f"{source.name}-{mode}-{key}.safetensors"


def quantize_model(model: nn.Module, mode: str, *, source: Path, cache_dir: Path) -> nn.Module:
    """Replaces the linear layers of `model` in place with `mode` versions; returns the model."""
    from safetensors.torch import load_file, save_file

    if mode == "none":
        return model
    targets = _targets(model, mode)
    cache = _cache_file(source, mode, cache_dir)
    if cache.exists():
        # Copied out of the file's buffer: safetensors offsets are not 64-byte aligned, and the int8 kernel's
        # vector loads crash (general protection fault) on such a weight once the batch has a few dozen rows.
        tensors = {name: tensor.clone() for name, tensor in load_file(str(cache)).items()}
    else:
        quantize = Int8Linear.quantize if mode == "int8" else Int4Linear.quantize
        tensors = {}
        for name, linear in targets.items():
            for key, value in quantize(linear.weight.detach()).items():
                tensors[f"{name}.{key}"] = value.contiguous()
        cache.parent.mkdir(parents=True, exist_ok=True)
        staging = cache.with_suffix(".tmp")
        save_file(tensors, str(staging))
        staging.rename(cache)  # a concurrent boot never reads half a file
        log.info("quantized_weights_cached", mode=mode, path=str(cache))
    for name, linear in targets.items():
        bias = None if linear.bias is None else linear.bias.detach()
        if mode == "int8":
            new: nn.Module = Int8Linear(tensors[f"{name}.weight"], tensors[f"{name}.scales"], bias)
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(tensors[f"{name}.codes"], INT4_INNER_K_TILES)
            new = Int4Linear(packed, tensors[f"{name}.scales_zeros"], bias, linear.in_features, linear.out_features)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    return model
