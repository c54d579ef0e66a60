"""Tiny checkpoints in the published quantized formats, written from a float checkpoint as their publishers'
tools write them: the tensor names, dtypes, shapes and `quantization_config` of the real ones.

    python -m deltafin.tiny.quantized --src FLOAT_FOLDER --out DIR --format mxfp4 [--modules experts]

- `int4`: compressed-tensors `pack-quantized` (Kimi K2-Thinking / K2.5): symmetric, a scale per group of 32
  (bfloat16), `weight_packed` int32 words (eight codes u = q + 8, element i at bits 4i), `weight_scale`,
  `weight_shape`; scale = max|w| / 7.5, q = round-half-even(w / scale) clamped to [-8, 7] (compressed-tensors'
  observer);
- `mxfp4`: compressed-tensors `mxfp4-pack-quantized` (Kimi K3): E8M0 scale per 32 (max|w| rounded to a power of
  two as compressed-tensors rounds it, then / 4), FP4 E2M1 codes two per byte, ties to even;
- `fp8`: DeepSeek-V3 / Kimi K2-Instruct: e4m3fn per weight, a float32 `weight_scale_inv` per 128x128 block
  (max|w| / 448; the edge blocks partial).

Which modules (`MODULES`): `experts` (the routed experts only: K2-Thinking, K3) or `linear` (every Linear but
the routers, the embeddings and the LM head: K2-Instruct's FP8). The config sits where the checkpoint keeps its
language model's (`text_config` of a multimodal K3). Files are converted one tensor at a time, so a checkpoint
of many GB is written in the memory of its largest tensor.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

FORMATS = ("int4", "mxfp4", "fp8")
#: which checkpoint keys a profile quantizes: the routed experts' projections, or every Linear weight but
#: the routers (`*.gate.weight`), embeddings and the LM head
_EXPERT = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
_NOT_LINEAR = re.compile(r"(embed_tokens|lm_head|\.gate|norm|layernorm)\.weight$|^(vision_tower|mm_projector)\.")
MODULES = ("experts", "linear")

_DTYPE_NAMES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.uint8: "U8",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.float8_e4m3fn: "F8_E4M3",
}
_FROM_NAMES = {name: dtype for dtype, name in _DTYPE_NAMES.items()}
_ITEM_BYTES = {name: torch.empty((), dtype=dtype).element_size() for dtype, name in _DTYPE_NAMES.items()}

# E2M1 magnitudes of codes 0..7 and the rounding thresholds between them (ties go to the even mantissa)
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def quantized_key(key: str, shape: tuple[int, ...], modules: str) -> bool:
    """Whether `modules` quantizes the checkpoint tensor `key` of `shape`."""
    if len(shape) != 2 or not key.endswith(".weight"):
        return False
    if modules == "experts":
        return _EXPERT.search(key) is not None
    return _NOT_LINEAR.search(key) is None


def _nibbles(u: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] (0..15) -> bytes [N, K/2], element 2j in the low nibble."""
    return u[:, 0::2] | (u[:, 1::2] << 4)


def _e2m1_index(magnitude: torch.Tensor) -> torch.Tensor:
    """|v| <= 6 -> the nearest E2M1 code 0..7, ties to the even mantissa (compressed-tensors' cast_to_fp4)."""
    thresholds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    # a tie rounds to the even code: up at 0.75, 1.75, 3.5 (codes 2, 4, 6), down at 0.25, 1.25, 2.5, 5.0
    up_at_tie = torch.tensor([False, True, False, True, False, True, False])
    index = torch.zeros(magnitude.shape, dtype=torch.uint8)
    for i in range(7):
        past = magnitude > thresholds[i]
        if up_at_tie[i]:
            past = past | (magnitude == thresholds[i])
        index += past.to(torch.uint8)
    return index


def mxfp4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """[N, K] float (K a multiple of 32) -> compressed-tensors MXFP4 tensors."""
    rows, cols = w.shape
    groups = w.float().reshape(rows, cols // 32, 32)
    amax = groups.abs().amax(-1)
    exponent = torch.floor(torch.log2(amax))
    mantissa = amax / torch.exp2(exponent) - 1
    exponent = exponent + (mantissa >= 0.75).float()  # compressed-tensors rounds max|w| up past 1.75 * 2^e
    scale_byte = torch.where(amax > 0, exponent - 2 + 127, torch.zeros_like(amax)).clamp(0, 254).to(torch.uint8)
    values = (groups / torch.exp2(scale_byte.float() - 127)[..., None]).clamp(-6, 6)
    magnitude = _e2m1_index(values.abs())
    code = magnitude | (((values < 0) & (magnitude > 0)).to(torch.uint8) << 3)
    return {"weight_packed": _nibbles(code.reshape(rows, cols)), "weight_scale": scale_byte}


def int4(w: torch.Tensor, group: int = 32, scale_dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """[N, K] float (K a multiple of `group` and of 8) -> compressed-tensors pack-quantized int4 tensors."""
    rows, cols = w.shape
    groups = w.float().reshape(rows, cols // group, group)
    scale = (groups.abs().amax(-1) / 7.5).to(scale_dtype)
    scale = torch.where(scale == 0, torch.full_like(scale, torch.finfo(scale_dtype).eps), scale)
    q = torch.round(groups / scale.float()[..., None]).clamp(-8, 7)
    u = (q + 8).to(torch.uint8).reshape(rows, cols)
    return {
        "weight_packed": _nibbles(u).contiguous().view(torch.int32),
        "weight_scale": scale,
        "weight_shape": torch.tensor([rows, cols], dtype=torch.int64),
    }


def fp8(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> dict[str, torch.Tensor]:
    """[N, K] float (any shape) -> e4m3fn weights and float32 block scales."""
    rows, cols = w.shape
    bn, bk = block
    grid_rows, grid_cols = -(-rows // bn), -(-cols // bk)
    padded = torch.zeros(grid_rows * bn, grid_cols * bk)
    padded[:rows, :cols] = w.float()
    blocks = padded.reshape(grid_rows, bn, grid_cols, bk)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return {"weight": q.reshape(grid_rows * bn, grid_cols * bk)[:rows, :cols].contiguous(), "weight_scale_inv": scale}


def quantize_tensor(fmt: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"int4": int4, "mxfp4": mxfp4, "fp8": fp8}[fmt](w)


def _output_shapes(fmt: str, shape: tuple[int, ...]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """suffix -> (dtype name, shape) of what `quantize_tensor` writes for a weight of `shape`."""
    rows, cols = shape
    if fmt == "int4":
        return {
            "weight_packed": ("I32", (rows, cols // 8)),
            "weight_scale": ("BF16", (rows, cols // 32)),
            "weight_shape": ("I64", (2,)),
        }
    if fmt == "mxfp4":
        return {"weight_packed": ("U8", (rows, cols // 2)), "weight_scale": ("U8", (rows, cols // 32))}
    return {"weight": ("F8_E4M3", (rows, cols)), "weight_scale_inv": ("F32", (-(-rows // 128), -(-cols // 128)))}


def quantization_config(fmt: str, modules: str) -> dict[str, Any]:
    """The config its publisher's tool writes (Kimi K2-Thinking's, K3's, K2-Instruct's)."""
    if fmt == "fp8":
        return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
    if modules == "experts" and fmt == "int4":  # K2-Thinking's ignore list
        ignore = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]
    elif modules == "experts":  # K3's, as published: incomplete (its latent projections are bfloat16 as well)
        ignore = [
            "re:.*self_attn.*",
            "re:.*shared_experts.*",
            "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
            "re:.*lm_head.*",
            "re:.*vision_tower.*",
            "re:.*mm_projector.*",
        ]
    else:
        ignore = ["lm_head", "re:.*\\.gate$"]
    weights: dict[str, Any] = {
        "actorder": None,
        "block_structure": None,
        "dynamic": False,
        "group_size": 32,
        "num_bits": 4,
        "observer": "minmax",
        "observer_kwargs": {},
        "strategy": "group",
        "symmetric": True,
        "type": "int" if fmt == "int4" else "float",
    }
    group: dict[str, Any] = {"input_activations": None, "output_activations": None, "targets": ["Linear"]}
    if fmt == "mxfp4":
        weights.update(scale_dtype="torch.uint8", zp_dtype=None)
        group["format"] = "mxfp4-pack-quantized"
    group["weights"] = weights
    return {
        "config_groups": {"group_0": group},
        "format": "pack-quantized" if fmt == "int4" else "mxfp4-pack-quantized",
        "global_compression_ratio": None,
        "ignore": ignore,
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }


def _headers(path: Path) -> tuple[int, dict[str, Any]]:
    from deltafin.engine.experts.checkpoint import read_header

    header = read_header(path)
    start = header.pop("__data_start__")
    header.pop("__metadata__", None)
    return start, header


def _read(path: Path, start: int, info: dict[str, Any]) -> torch.Tensor:
    begin, end = info["data_offsets"]
    with path.open("rb") as handle:
        handle.seek(start + begin)
        raw = bytearray(handle.read(end - begin))
    return torch.frombuffer(raw, dtype=_FROM_NAMES[info["dtype"]]).reshape(info["shape"]) if raw else torch.empty(0)


def _read_as(path: Path, start: int, info: dict[str, Any], dtype: torch.dtype) -> torch.Tensor:
    return _read(path, start, info).to(dtype)


def write_safetensors(path: Path, entries: list[tuple[str, str, tuple[int, ...], Callable[[], torch.Tensor]]]) -> None:
    """A safetensors file of `entries` (name, dtype name, shape, producer), each tensor produced as it is
    written."""
    header: dict[str, Any] = {}
    at = 0
    for name, dtype, shape, _ in entries:
        nbytes = math.prod(shape) * _ITEM_BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + nbytes]}
        at += nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as handle:
        handle.write(len(raw).to_bytes(8, "little") + raw)
        for name, dtype, shape, produce in entries:
            tensor = produce().contiguous()
            if _DTYPE_NAMES[tensor.dtype] != dtype or tuple(tensor.shape) != tuple(shape):
                raise AssertionError(f"{name}: produced {tensor.dtype} {list(tensor.shape)}, planned {dtype} {shape}")
            handle.write(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")


def quantize_folder(
    src: Path, out: Path, fmt: str | None, modules: str = "experts", *, cast: torch.dtype | None = None
) -> Path:
    """`out`: the float checkpoint `src` with the tensors `modules` names stored in `fmt` (and, with `cast`,
    the other float tensors in that dtype), the quantization config where `src` keeps its model's config.
    `fmt` None: nothing quantized (a copy in `cast`'s dtype: the same model as a bfloat16 checkpoint)."""
    if fmt is not None and fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r} (known: {', '.join(FORMATS)})")
    from deltafin.engine.experts.checkpoint import checkpoint_files

    out.mkdir(parents=True, exist_ok=True)
    files = checkpoint_files(src)
    weight_map: dict[str, str] = {}
    for path in files:
        start, header = _headers(path)
        entries = list(_converted(path, start, header, fmt, modules, cast))
        write_safetensors(out / path.name, entries)
        weight_map.update({name: path.name for name, *_ in entries})
    if (src / "model.safetensors.index.json").exists():
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for item in src.iterdir():
        if item.suffix != ".safetensors" and item.name not in ("model.safetensors.index.json", "config.json"):
            (shutil.copytree if item.is_dir() else shutil.copy2)(item, out / item.name)
    config = json.loads((src / "config.json").read_text())
    holder = config["text_config"] if isinstance(config.get("text_config"), dict) else config
    if fmt is not None:
        holder["quantization_config"] = quantization_config(fmt, modules)
    if cast is not None:
        holder["dtype"] = str(cast).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    meta = out / "deltafin_tiny.json"
    if meta.exists():
        data = json.loads(meta.read_text())
        data["quantized"] = {"format": fmt, "modules": modules, "cast": str(cast) if cast else None}
        meta.write_text(json.dumps(data))
    return out


def _converted(
    path: Path, start: int, header: dict[str, Any], fmt: str | None, modules: str, cast: torch.dtype | None
) -> Iterator[tuple[str, str, tuple[int, ...], Callable[[], torch.Tensor]]]:
    for name, info in header.items():
        shape = tuple(info["shape"])
        if fmt is not None and quantized_key(name, shape, modules) and _fits(fmt, shape):
            base = name.removesuffix(".weight")
            cache: dict[str, dict[str, torch.Tensor]] = {}

            def part(suffix: str, info: dict[str, Any] = info, cache: dict = cache) -> torch.Tensor:
                if "tensors" not in cache:
                    cache["tensors"] = quantize_tensor(fmt, _read(path, start, info).float())
                return cache["tensors"].pop(suffix)

            for suffix, (dtype, out_shape) in _output_shapes(fmt, shape).items():
                yield f"{base}.{suffix}", dtype, out_shape, functools.partial(part, suffix)
        else:
            dtype = info["dtype"]
            if cast is not None and dtype in ("F32", "BF16", "F16"):
                dtype = _DTYPE_NAMES[cast]
            yield (
                name,
                dtype,
                shape,
                functools.partial(_read_as, path, start, info, _FROM_NAMES[dtype]),
            )


def _fits(fmt: str, shape: tuple[int, ...]) -> bool:
    """The 4-bit formats need whole groups of 32 along the width (a module that has not stays float)."""
    return fmt == "fp8" or shape[1] % 32 == 0


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m deltafin.tiny.quantized", description=__doc__.split("\n")[0])
    parser.add_argument("--src", required=True, type=Path, help="a float checkpoint folder")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--format", required=True, choices=FORMATS)
    parser.add_argument("--modules", default=None, choices=MODULES, help="default: linear for fp8, else experts")
    parser.add_argument(
        "--cast", default=None, choices=["bfloat16", "float16", "float32"], help="the float tensors' dtype"
    )
    args = parser.parse_args()
    modules = args.modules or ("linear" if args.format == "fp8" else "experts")
    quantize_folder(args.src, args.out, args.format, modules, cast=getattr(torch, args.cast) if args.cast else None)
    print(f"wrote {args.src} in {args.format} ({modules}) to {args.out}")


if __name__ == "__main__":
    main()
