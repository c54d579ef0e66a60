"""Small C kernels the CPU engine compiles on first use with the system's C compiler, and their fallbacks.

A kernel is built once per machine into the cache folder (`~/.cache/deltafin/kernels/`), keyed on its source,
the compiler and the CPU's instruction-set flags (it is built with -march=native), then loaded with ctypes.
Where no compiler is found or the build fails, `int8_matvec()` returns None and callers use torch's own
kernel: slower, never wrong. `DELTAFIN_KERNELS=0` turns the C kernels off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

import structlog
import torch

log = structlog.get_logger("deltafin.engine")

SOURCE_DIR = Path(__file__).parent
# Reassociation lets the compiler vectorize the dot product's sum. Not -ffast-math: a shared library built
# with it sets flush-to-zero for the whole process when loaded (gcc links crtfastmath.o), which broke msgspec's
# `gt=0.0` checks (the smallest denormal became 0, so top_p=0 passed validation).
FLAGS = ["-O3", "-march=native", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math", "-fopenmp",
         "-shared", "-fPIC"]

#: (x [M, K] float32, w [N, K] int8, scale [N] float32, bias [N] float32 | None) -> y [M, N] float32
Int8Matvec = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def _build(name: str) -> Path | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("kernel_unavailable", kernel=name, reason="no C compiler found")
        return None
    source = SOURCE_DIR / f"{name}.c"
    key = hashlib.sha256(source.read_bytes() + " ".join([compiler, *FLAGS, _cpu_flags()]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "deltafin"  # as the model cache
    target = cache / "kernels" / f"{name}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        staged = Path(work) / target.name
        done = subprocess.run([compiler, *FLAGS, str(source), "-o", str(staged)], capture_output=True, text=True)
        if done.returncode != 0:
            log.warning("kernel_unavailable", kernel=name, reason=done.stderr.strip()[-500:])
            return None
        staged.rename(target)  # a concurrent build never leaves half a library behind
    log.info("kernel_built", kernel=name, path=str(target))
    return target


@functools.cache
def int8_matvec() -> Int8Matvec | None:
    """The int8 weight-only matmul for a few rows (deltafin/engine/kernels/int8_matvec.c), or None."""
    if os.environ.get("DELTAFIN_KERNELS", "1") == "0":
        return None
    try:
        library = _build("int8_matvec")
    except OSError as exc:  # e.g. a read-only cache folder: torch's kernel still works
        log.warning("kernel_unavailable", kernel="int8_matvec", reason=str(exc))
        return None
    if library is None:
        return None
    function = ctypes.CDLL(str(library)).int8_matvec
    function.restype = None
    function.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int]

    def run(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x = x.contiguous()
        (m, k), n = x.shape, w.shape[0]
        y = torch.empty(m, n, dtype=torch.float32)
        function(x.data_ptr(), w.data_ptr(), scale.data_ptr(), None if bias is None else bias.data_ptr(),
                 y.data_ptr(), m, n, k, torch.get_num_threads())
        return y

    return run
