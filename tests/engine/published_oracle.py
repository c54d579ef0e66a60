"""The oracle for the published quantized formats: each format's definition written again here, in numpy and
float64, independent of Deltafin's code, and a float32 checkpoint of a quantized one's weights so defined.

    int4:  W[n, k] = (u(n, k) - 8) * scale[n, k // G]           u: nibble k of row n (2j low, 2j+1 high)
    mxfp4: W[n, k] = E2M1[u(n, k)] * 2^(scale[n, k // 32] - 127)
    fp8:   W[n, k] = e4m3fn(w[n, k]) * scale_inv[n // bn, k // bk]  (each part of a stacked matrix its own grid)

A product of a 4-bit value and its scale is exact in float32 (bfloat16 / float16 / E8M0 scales); an FP8 value
times a float32 scale is rounded once to float32, as the kernels compute it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float64)


def e4m3fn(codes: np.ndarray) -> np.ndarray:
    """e4m3fn bytes -> float64 values (bias 7, no infinities; NaN for 0x7F and 0xFF)."""
    codes = codes.astype(np.int64)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent, mantissa = (codes >> 3) & 0x0F, codes & 0x07
    value = np.where(exponent == 0, mantissa / 8.0 * 2.0**-6, (1 + mantissa / 8.0) * 2.0 ** (exponent - 7.0))
    value = np.where((codes & 0x7F) == 0x7F, np.nan, value)
    return sign * value


def nibbles(packed: np.ndarray) -> np.ndarray:
    """bytes [N, K/2] -> codes [N, K]: element 2j the low nibble of byte j."""
    return np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(packed.shape[0], -1)


def int4(packed_bytes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    codes = nibbles(packed_bytes).astype(np.float64) - 8
    group = codes.shape[1] // scales.shape[1]
    return codes * np.repeat(scales.astype(np.float64), group, axis=1)


def mxfp4(packed_bytes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    return E2M1[nibbles(packed_bytes)] * np.repeat(np.exp2(scales.astype(np.float64) - 127), 32, axis=1)


def fp8(codes: np.ndarray, scale_inv: np.ndarray, block=(128, 128), part_rows: int | None = None) -> np.ndarray:
    rows, cols = codes.shape
    part_rows = part_rows or rows
    per_part = -(-part_rows // block[0])
    n = np.arange(rows)
    grid_rows = (n // part_rows) * per_part + (n % part_rows) // block[0]
    return e4m3fn(codes) * scale_inv.astype(np.float64)[grid_rows][:, np.arange(cols) // block[1]]


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    if tensor.dtype == torch.bfloat16:
        return tensor.float().numpy()  # exact
    if tensor.dtype == torch.float8_e4m3fn:
        return tensor.view(torch.uint8).numpy()
    return tensor.numpy()


def dequantized_tensors(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of the quantized checkpoint `folder` with its quantized modules' weights dequantized by the
    definitions above (float64), under `M.weight`."""
    from safetensors import safe_open

    config = json.loads((folder / "config.json").read_text())
    quant = config.get("quantization_config") or config["text_config"]["quantization_config"]
    raw: dict[str, np.ndarray] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                raw[key] = _numpy(handle.get_tensor(key))
    block = tuple(quant.get("weight_block_size", (128, 128)))
    out: dict[str, np.ndarray] = {}
    for key, value in raw.items():
        module, _, suffix = key.rpartition(".")
        if suffix in ("weight_scale", "weight_shape", "weight_scale_inv"):
            continue
        if suffix == "weight_packed":
            scales = raw[f"{module}.weight_scale"]
            as_bytes = np.ascontiguousarray(value).view(np.uint8)
            if value.dtype == np.int32:  # int4: little-endian words
                weight = int4(as_bytes, scales)
                assert list(raw[f"{module}.weight_shape"]) == list(weight.shape)
            else:
                weight = mxfp4(as_bytes, scales)
            out[f"{module}.weight"] = weight
        elif f"{module}.weight_scale_inv" in raw and suffix == "weight":
            out[key] = fp8(value, raw[f"{module}.weight_scale_inv"], block)  # type: ignore[arg-type]
        else:
            out[key] = value.astype(np.float64) if value.dtype.kind == "f" else value
    return out


def dequantized_folder(folder: Path, out: Path) -> Path:
    """A float32 checkpoint of the weights `folder` stands for (its config without the quantization config,
    everything else copied)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        key: torch.from_numpy(np.ascontiguousarray(value.astype(np.float32) if value.dtype.kind == "f" else value))
        for key, value in dequantized_tensors(folder).items()
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for item in folder.iterdir():
        if item.suffix != ".safetensors" and item.name not in ("config.json", "model.safetensors.index.json"):
            (shutil.copytree if item.is_dir() else shutil.copy2)(item, out / item.name)
    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config", None)
    if isinstance(config.get("text_config"), dict):
        config["text_config"].pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
