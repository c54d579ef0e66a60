"""Weight-only quantization of a model's linear layers at load (`placement.quantize`: none | int8 | int4).

int8: one scale per output channel, run by `torch.ops.aten._weight_int8pack_mm`; int4: groups of
`INT4_GROUP` input channels with a scale and a zero each, packed for `_weight_int4pack_mm_for_cpu` (gpt-fast's
recipe). Both kernels run with bfloat16 activations (measured 2-3x faster than float32 activations on this
CPU; the result goes back to the model's dtype). The quantized tensors are cached as safetensors in the cache
folder (keyed on the source folder's weights and the mode), so later boots skip the quantization.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import structlog
import torch
from torch import nn

log = structlog.get_logger("deltafin.engine")

MODES = ("none", "int8", "int4")
INT4_GROUP = 32
INT4_INNER_K_TILES = 2
COMPUTE = torch.bfloat16


class Int8Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)  # [N, K] int8
        self.register_buffer("scales", scales)  # [N] float
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @staticmethod
    def quantize(weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """weight: [N, K] float -> int8 [N, K] and per-channel scales [N] (symmetric, max-abs)."""
        w = weight.float()
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-8)  # [N]
        q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        return {"weight": q, "scales": scales.to(COMPUTE)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = torch.ops.aten._weight_int8pack_mm(
            x.reshape(-1, self.in_features).to(COMPUTE), self.weight, self.scales
        ).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)


class Int4Linear(nn.Module):
    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, bias: torch.Tensor | None,
                 in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", packed)  # packed int4, layout owned by the kernel
        self.register_buffer("scales_zeros", scales_zeros)  # [K / group, N, 2]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @staticmethod
    def quantize(weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """weight: [N, K] -> 4-bit codes [N, K] (int32, 0..15) and (scale, zero) per group of INT4_GROUP."""
        w = weight.float()
        groups = w.reshape(-1, INT4_GROUP)  # [N * K / g, g]
        lo, hi = groups.amin(dim=1, keepdim=True), groups.amax(dim=1, keepdim=True)
        scales = (hi - lo).clamp(min=1e-6) / 15
        zeros = lo + scales * 8  # the kernel computes (q - 8) * scale + zero
        codes = groups.sub(lo).div(scales).round().clamp(0, 15).to(torch.int32).reshape_as(w)
        n = w.shape[0]
        scales_zeros = torch.cat([scales.reshape(n, -1, 1), zeros.reshape(n, -1, 1)], dim=2).transpose(0, 1)
        return {"codes": codes, "scales_zeros": scales_zeros.to(COMPUTE).contiguous()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(-1, self.in_features).to(COMPUTE), self.weight, INT4_GROUP, self.scales_zeros
        ).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)


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


def _cache_file(source: Path, mode: str, cache_dir: Path) -> Path:
    digest = hashlib.sha256(f"{mode}:{INT4_GROUP}:{COMPUTE}".encode())
    for file in sorted(source.glob("*.safetensors")):
        stat = file.stat()
        digest.update(f"{file.name}:{stat.st_size}:{int(stat.st_mtime)}".encode())
    return cache_dir / "quantized" / f"{source.name}-{mode}-{digest.hexdigest()[:12]}.safetensors"


def quantize_model(model: nn.Module, mode: str, *, source: Path, cache_dir: Path) -> nn.Module:
    """Replaces the linear layers of `model` in place with `mode` versions; returns the model."""
    from safetensors.torch import load_file, save_file

    if mode == "none":
        return model
    targets = _targets(model, mode)
    cache = _cache_file(source, mode, cache_dir)
    if cache.exists():
        tensors = load_file(str(cache))
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
