"""K-quant GGUF files (Q4_K, Q5_K, Q6_K) written from another GGUF, for tests and benchmarks of the native
K-quant kernels (nothing can be downloaded here, and the `gguf` package quantizes only the 32-value formats).

The quantizers are simple ones, NOT llama.cpp's optimized ones (which search scales and mins per sub-block to
minimise the error): per 32-value sub-block (Q4_K / Q5_K) the minimum (clamped at 0) and range give a scale and
min, rounded to 6 bits against the super-block's half d and dmin; per 16-value group (Q6_K) a signed scale
max|x| / 31 rounded to 8 bits against the super-block's half d. The layouts are ggml's (the `gguf` package's
quants.py dequantizes them: the tests compare the kernels with it).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

QK_K = 256


def _half(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float -> (float16 values as float32, their bytes [..., 2])."""
    h = x.astype(np.float16)
    return h.astype(np.float32), h[..., None].view(np.uint8)


def _round(x: np.ndarray) -> np.ndarray:
    return np.floor(x + 0.5)


def quantize_q45_k(w: np.ndarray, bits: int) -> np.ndarray:
    """[N, K] float32 (K % 256 == 0) -> Q4_K (bits 4) or Q5_K (bits 5) blocks, uint8 [N, K / 256 * bytes]."""
    n, k = w.shape
    top = (1 << bits) - 1
    x = w.astype(np.float32).reshape(n, k // QK_K, 8, 32)  # [N, super-blocks, sub-blocks, 32]
    low = np.minimum(x.min(axis=-1), 0.0)  # min (<= 0: w = scale * u - mn with mn >= 0)
    scale = (x.max(axis=-1) - low) / top
    mn = -low
    d, d_bytes = _half(scale.max(axis=-1) / 63)
    dmin, dmin_bytes = _half(mn.max(axis=-1) / 63)
    safe = lambda v: np.where(v > 0, v, 1.0)  # noqa: E731
    sc = np.clip(_round(scale / safe(d)[..., None]), 0, 63).astype(np.uint8)
    m = np.clip(_round(mn / safe(dmin)[..., None]), 0, 63).astype(np.uint8)
    dw = d[..., None] * sc.astype(np.float32)
    mw = dmin[..., None] * m.astype(np.float32)
    u = np.clip(_round((x + mw[..., None]) / safe(dw)[..., None]), 0, top).astype(np.uint8)
    u = np.where(dw[..., None] > 0, u, 0).astype(np.uint8)
    scales = np.empty(x.shape[:2] + (12,), dtype=np.uint8)
    scales[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    scales[..., 4:8] = m[..., :4] | ((m[..., 4:] >> 4) << 6)
    scales[..., 8:12] = (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4)
    low4 = u & 0x0F
    qs = (low4[:, :, 0::2, :] | (low4[:, :, 1::2, :] << 4)).reshape(n, k // QK_K, 128)
    parts = [d_bytes, dmin_bytes, scales]
    if bits == 5:  # bit j of qh[i]: bit 4 of sub-block j's code i
        high = ((u >> 4) & 1).astype(np.uint8)  # [N, S, 8, 32]
        qh = np.zeros(x.shape[:2] + (32,), dtype=np.uint8)
        for j in range(8):
            qh |= high[:, :, j, :] << j
        parts.append(qh)
    parts.append(qs)
    return np.concatenate(parts, axis=-1).reshape(n, -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """[N, K] float32 (K % 256 == 0) -> Q6_K blocks, uint8 [N, K / 256 * 210]."""
    n, k = w.shape
    x = w.astype(np.float32).reshape(n, k // QK_K, 16, 16)  # [N, super-blocks, groups of 16, 16]
    scale = np.abs(x).max(axis=-1) / 31  # per 16 values, >= 0
    d, d_bytes = _half(scale.max(axis=-1) / 127)
    safe = lambda v: np.where(v != 0, v, 1.0)  # noqa: E731
    sc = np.clip(_round(scale / safe(d)[..., None]), -128, 127).astype(np.int8)
    dw = d[..., None] * sc.astype(np.float32)
    q = np.clip(_round(x / safe(dw)[..., None]), -32, 31)
    q = (np.where(dw[..., None] != 0, q, 0) + 32).astype(np.uint8).reshape(n, k // QK_K, 2, 4, 32)  # [.., half, jj, i]
    ql = np.zeros((n, k // QK_K, 2, 64), dtype=np.uint8)
    qh = np.zeros((n, k // QK_K, 2, 32), dtype=np.uint8)
    for jj in range(4):
        ql[..., 32 * (jj % 2) : 32 * (jj % 2) + 32] |= (q[:, :, :, jj, :] & 0x0F) << (4 * (jj // 2))
        qh |= (q[:, :, :, jj, :] >> 4) << (2 * jj)
    parts = [ql.reshape(n, k // QK_K, 128), qh.reshape(n, k // QK_K, 64), sc.view(np.uint8), d_bytes]
    return np.concatenate(parts, axis=-1).reshape(n, -1)


def quantize_k(w: np.ndarray, name: str) -> np.ndarray:
    return {
        "Q4_K": lambda: quantize_q45_k(w, 4),
        "Q5_K": lambda: quantize_q45_k(w, 5),
        "Q6_K": lambda: quantize_q6_k(w),
    }[name]()


def rewrite_gguf(source: Path, target: Path, convert) -> Path:
    """`source` GGUF written to `target` with its metadata, each tensor as `convert(tensor)` gives it: (data, its
    ggml type, or None for float32 values). Written under a temporary name and renamed; an existing `target` is
    kept as it is."""
    import gguf

    if target.exists():
        return target
    reader = gguf.GGUFReader(str(source))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    writer = gguf.GGUFWriter(str(target) + ".tmp", arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    for tensor in reader.tensors:
        data, qtype = convert(tensor)
        if qtype is None:
            writer.add_tensor(tensor.name, data)
        else:
            writer.add_tensor(tensor.name, data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.rename(str(target) + ".tmp", target)
    return target


def requantize_k(source: Path, target: Path, name: str, rest: str = "Q8_0", odd_layers: str | None = None) -> Path:
    """`source` GGUF with every matrix of input width a multiple of 256 in K-quant `name` (`odd_layers`: that
    K-quant instead in odd-numbered layers, as Q4_K_M files mix Q4_K and Q6_K), the other matrices in `rest` (a
    gguf-quantizable type name, or "keep": their blocks as they are); metadata copied."""
    import gguf

    def convert(tensor):
        matrix = len(tensor.shape) == 2 and tensor.tensor_type != gguf.GGMLQuantizationType.F32
        if matrix and rest == "keep" and int(tensor.shape[0]) % QK_K:
            return np.asarray(tensor.data), tensor.tensor_type
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if not matrix:
            return values, None
        if int(tensor.shape[0]) % QK_K == 0:
            odd = tensor.name.startswith("blk.") and int(tensor.name.split(".")[1]) % 2 == 1
            chosen = odd_layers if odd and odd_layers else name
            return quantize_k(values, chosen), gguf.GGMLQuantizationType[chosen]
        other = gguf.GGMLQuantizationType[rest]
        return gguf.quants.quantize(values, other), other

    return rewrite_gguf(source, target, convert)
