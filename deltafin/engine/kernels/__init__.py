"""Small C kernels the CPU engine compiles on first use with the system's C compiler, in explicit CPU variants
chosen at run time, and their fallbacks.

Variants (`VARIANTS`): `portable` (plain C, any x86-64 or other CPU), `avx2` (AVX2 + FMA + F16C) and `avx512`
(AVX-512 F/BW/VL/DQ + VNNI). Each is built with its own fixed flags (never -march=native, so a cache folder or
a CI machine with another CPU never loads a library it cannot run). The portable library is built first and
asks the CPU what it supports (`__builtin_cpu_supports`); the best variant the CPU runs is used.
`DELTAFIN_KERNEL_VARIANT=portable|avx2|avx512` forces one (a variant the CPU cannot run is refused with a
warning, and the best one it can run is used); `DELTAFIN_KERNELS=0` turns the C kernels off (callers fall back
to torch: slower, never wrong).

A library is built once per machine into the cache folder (`~/.cache/deltafin/kernels/`), keyed on its
sources, the compiler and the flags, then loaded with ctypes. Where no compiler is found or a build fails,
the accessors return None.

Libraries:
- `ggml` (`ggml_quants.c` + `llama_step.c`): GGUF block-quantized matmul (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and
  the K-quants Q4_K, Q5_K, Q6_K, whose 256-value super-blocks need widths in multiples of 256), dequantization,
  and whole Llama forward passes (a batch's decode step, a prefill window). The same bits in every variant (see
  ggml_quants.c).
- `int8_matvec`: the int8 weight-only kernel of `placement.quantize=int8`.
- `packed` (`packed_quants.c`): published checkpoints' quantized weights in their stored form (compressed-tensors
  int4 and MXFP4 codes with their group scales, DeepSeek-V3 FP8 blocks) times float32 activations, and their
  dequantization. The same bits in every variant (see packed_quants.c).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import structlog
import torch

log = structlog.get_logger("deltafin.engine")

SOURCE_DIR = Path(__file__).parent
#: per variant: the macro the sources test and the instruction-set flags
VARIANTS: dict[str, list[str]] = {
    "portable": [],
    "avx2": ["-DDELTAFIN_VARIANT_AVX2", "-mavx2", "-mfma", "-mf16c"],
    "avx512": [
        "-DDELTAFIN_VARIANT_AVX512",
        "-mavx2",
        "-mfma",
        "-mf16c",
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        "-mavx512vnni",
    ],
}
#: `deltafin_cpu_features()` bits a variant needs
_NEEDS = {"portable": 0, "avx2": 1, "avx512": 3}
#: variant names in order of preference
_BEST_FIRST = ("avx512", "avx2", "portable")
COMMON = ["-O3", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno"]
#: per library: its sources and own flags.
#: ggml: no contraction into FMA and no reassociation, so every variant computes the same IEEE operations.
#: int8_matvec: reassociation lets the compiler vectorize its dot product's sum. Never -ffast-math: a shared
#: library built with it sets flush-to-zero for the whole process when loaded (gcc links crtfastmath.o), which
#: broke msgspec's `gt=0.0` checks (the smallest denormal became 0, so top_p=0 passed validation).
LIBRARIES: dict[str, tuple[list[str], list[str]]] = {
    "ggml": (["llama_step.c", "ggml_quants.c"], ["-ffp-contract=off"]),
    "int8_matvec": (["int8_matvec.c"], ["-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]),
    "packed": (["packed_quants.c"], ["-ffp-contract=off"]),
}

#: (x [M, K] float32, w [N, K] int8, scale [N] float32, bias [N] float32 | None) -> y [M, N] float32
Int8Matvec = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def _enabled() -> bool:
    return os.environ.get("DELTAFIN_KERNELS", "1") != "0"


def _cache_folder() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "deltafin" / "kernels"


def _build(name: str, variant: str) -> Path | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("kernel_unavailable", kernel=name, reason="no C compiler found")
        return None
    sources, own_flags = LIBRARIES[name]
    flags = [*COMMON, *own_flags, *VARIANTS[variant]]
    digest = hashlib.sha256(" ".join([compiler, *flags]).encode())
    for source in sources:
        digest.update((SOURCE_DIR / source).read_bytes())
    target = _cache_folder() / f"{name}-{variant}-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        staged = Path(work) / target.name
        # One translation unit: the first source includes the others it needs.
        command = [compiler, *flags, str(SOURCE_DIR / sources[0]), "-o", str(staged)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            log.warning("kernel_unavailable", kernel=name, variant=variant, reason=done.stderr.strip()[-500:])
            return None
        staged.rename(target)  # a concurrent build never leaves half a library behind
    log.info("kernel_built", kernel=name, variant=variant, path=str(target))
    return target


def _load(name: str, variant: str) -> ctypes.CDLL | None:
    try:
        library = _build(name, variant)
    except OSError as exc:  # e.g. a read-only cache folder: torch's kernels still work
        log.warning("kernel_unavailable", kernel=name, reason=str(exc))
        return None
    return None if library is None else ctypes.CDLL(str(library))


@functools.cache
def cpu_features() -> int:
    """What this CPU runs, asked by the portable library: bit 0 AVX2+FMA, bit 1 AVX-512 with VNNI (0 without a compiler)."""
    portable = _load("ggml", "portable") if _enabled() else None
    return int(portable.deltafin_cpu_features()) if portable is not None else 0


def supported_variants() -> list[str]:
    """The variants this CPU can run, best first."""
    features = cpu_features()
    return [v for v in _BEST_FIRST if features & _NEEDS[v] == _NEEDS[v]]


@functools.cache
def variant() -> str:
    """The variant the kernels run as: `DELTAFIN_KERNEL_VARIANT` when the CPU runs it, else the best one."""
    runnable = supported_variants()
    wanted = os.environ.get("DELTAFIN_KERNEL_VARIANT", "").strip().lower()
    if wanted and wanted in runnable:
        return wanted
    if wanted:
        log.warning(
            "kernel_variant_refused",
            wanted=wanted,
            runnable=runnable,
            reason="unknown variant" if wanted not in VARIANTS else "this CPU cannot run it",
        )
    return runnable[0]


def _int(fn, restype=ctypes.c_int, argtypes=()):
    fn.restype, fn.argtypes = restype, list(argtypes)
    return fn


P, I64, I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


@functools.cache
def ggml() -> ctypes.CDLL | None:
    """The GGUF block-quantized kernels and the Llama decode step (variant `variant()`), or None."""
    if not _enabled():
        return None
    library = _load("ggml", variant())
    if library is None:
        return None
    _int(library.deltafin_ggml_matmul, I32, [P, I64, P, I32, I64, I64, I64, P, P, I32])
    _int(library.deltafin_ggml_dequantize, I32, [P, I32, I64, I64, P, I64, P])
    _int(library.deltafin_ggml_quantize_activations, None, [P, I64, I64, P, P, P])
    _int(library.deltafin_ggml_supported, I32, [I32])
    _int(library.deltafin_ggml_block_bytes, I64, [I32])
    _int(library.deltafin_ggml_block_values, I64, [I32])
    _int(library.deltafin_ggml_repack, I32, [P, I32, I64, I64, I64, P])
    _int(library.deltafin_kernel_variant, I32, [])
    _int(library.deltafin_llama_forward, I32, [P, P, P, P, P, P, I64, I64, I64, P, P, P, P, P, I64, I32])
    log.info("kernel_variant", variant=variant(), cpu_features=cpu_features())
    return library


@functools.cache
def packed() -> ctypes.CDLL | None:
    """The kernels of published quantized formats (int4, MXFP4, FP8 blocks; variant `variant()`), or None."""
    if not _enabled():
        return None
    library = _load("packed", variant())
    if library is None:
        return None
    _int(library.deltafin_packed4_matmul, I32, [P, I64, I64, I64, P, I64, P, I32, I64, I64, I32, I64, P, P, I64, I32])
    _int(library.deltafin_packed4_dequantize, I32, [P, I64, P, I32, I64, I64, I32, I64, I64, P, I64, P])
    _int(library.deltafin_fp8_matmul, I32, [P, I64, I64, I64, P, I64, P, I64, I64, I64, I64, I64, P, P, I64, I32])
    _int(library.deltafin_fp8_dequantize, I32, [P, I64, P, I64, I64, I64, I64, I64, I64, P, I64, P])
    _int(library.deltafin_packed4_grouped, I32, [I64, P, P, I64, I64, P, I64, P, I32, I64, I64, I32, I64, P, I64, I32])
    _int(library.deltafin_fp8_grouped, I32, [I64, P, P, I64, I64, P, I64, P, I64, I64, I64, I64, I64, P, I64, I32])
    _int(library.deltafin_packed_variant, I32, [])
    return library


@functools.cache
def int8_matvec() -> Int8Matvec | None:
    """The int8 weight-only matmul for a few rows (deltafin/engine/kernels/int8_matvec.c), or None."""
    if not _enabled():
        return None
    library = _load("int8_matvec", variant())
    if library is None:
        return None
    function = library.int8_matvec
    function.restype = None
    function.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int]

    def run(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x = x.contiguous()
        (m, k), n = x.shape, w.shape[0]
        y = torch.empty(m, n, dtype=torch.float32)
        function(
            x.data_ptr(),
            w.data_ptr(),
            scale.data_ptr(),
            None if bias is None else bias.data_ptr(),
            y.data_ptr(),
            m,
            n,
            k,
            torch.get_num_threads(),
        )
        return y

    return run
