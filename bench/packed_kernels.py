"""The 4-bit kernels (MXFP4, int4) at the bench MoE's expert shapes, as the pool calls them: per layer, one
grouped call for 4 experts' gate_up [1536, 1024] and one for their down [1024, 768], 1, 4 or 16 activation
rows per expert, over 64 experts a layer (80 MB of packed weights: none of it stays in the cache). With
`--against SOURCE`, another `packed_quants.c` (an earlier commit's: `git show COMMIT:deltafin/engine/kernels/
packed_quants.c > FILE`) is built with the same flags and timed alternately beside this tree's, best of 7 each.

    flock /tmp/deltafin-bench.lock .venv/bin/python bench/packed_kernels.py --against /tmp/buffered_packed_quants.c
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deltafin.engine import kernels  # noqa: E402

EXPERTS, TOP_K = 64, 4
SHAPES = {"gate_up": (1536, 1024), "down": (1024, 768)}
FORMATS = {"mxfp4": (2, 3), "int4": (1, 0)}  # the kernel's format number, scale type (E8M0, bfloat16)


def build(source: Path, work: Path) -> ctypes.CDLL:
    """`source` as the packed library of this CPU's variant, with the flags deltafin.engine.kernels uses."""
    sources, own = kernels.LIBRARIES["packed"]
    target = work / f"{source.stem}-{len(list(work.iterdir()))}.so"
    flags = [*kernels.COMMON, *own, *kernels.VARIANTS[kernels.variant()]]
    subprocess.run(["cc", *flags, str(source), "-o", str(target)], check=True)
    library = ctypes.CDLL(str(target))
    P, I64, I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    function = library.deltafin_packed4_grouped
    function.restype = I32
    function.argtypes = [I64, P, P, I64, I64, P, I64, P, I32, I64, I64, I32, I64, P, I64, I32]
    return library


def weights(fmt: str, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n + k)
    codes = torch.randint(0, 256, (EXPERTS, n, k // 2), dtype=torch.uint8, generator=g)
    if fmt == "mxfp4":
        scales = torch.randint(120, 130, (EXPERTS, n, k // 32), dtype=torch.uint8, generator=g)
    else:
        scales = (torch.randn(EXPERTS, n, k // 32, generator=g) * 0.05).bfloat16()
    return codes, scales


def layer_ms(library: ctypes.CDLL, fmt: str, matrices: dict, rows: int, threads: int, steps: int) -> float:
    """Milliseconds per layer: `steps` layers, each 4 experts (a different 4 each time) times `rows` rows."""
    number, scale_type = FORMATS[fmt]
    pointers = ctypes.c_void_p * TOP_K
    counts = (ctypes.c_int64 * TOP_K)(*([rows] * TOP_K))
    buffers = {name: (torch.randn(TOP_K * rows, k), torch.empty(TOP_K * rows, n)) for name, (n, k) in SHAPES.items()}
    started = time.perf_counter()
    for step in range(steps):
        experts = [(step * TOP_K + i * 17) % EXPERTS for i in range(TOP_K)]
        for name, (codes, scales) in matrices.items():
            x, y = buffers[name]
            n, k = SHAPES[name]
            failed = library.deltafin_packed4_grouped(
                TOP_K, pointers(*(x.data_ptr() + i * rows * k * 4 for i in range(TOP_K))), counts, k, k,
                pointers(*(codes[e].data_ptr() for e in experts)), codes.stride(1),
                pointers(*(scales[e].data_ptr() for e in experts)), scale_type, scales.stride(1), 32, number, n,
                pointers(*(y.data_ptr() + i * rows * n * 4 for i in range(TOP_K))), n, threads,
            )  # fmt: skip
            assert failed == 0
    return (time.perf_counter() - started) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", type=Path, help="another packed_quants.c to time beside this tree's")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        libraries = {"this tree": build(kernels.SOURCE_DIR / "packed_quants.c", Path(work))}
        if args.against:
            libraries["against"] = build(args.against, Path(work))
        print(f"variant {kernels.variant()}, {args.threads} thread(s); ms per layer (4 experts), best of 7")
        for fmt in FORMATS:
            matrices = {name: weights(fmt, *shape) for name, shape in SHAPES.items()}
            for rows in args.rows:
                best = dict.fromkeys(libraries, float("inf"))
                for _ in range(7):  # alternating, so a busy moment falls on both
                    for name, library in libraries.items():
                        ms = layer_ms(library, fmt, matrices, rows, args.threads, max(8, 256 // rows))
                        best[name] = min(best[name], ms)
                macs = TOP_K * rows * sum(n * k for n, k in SHAPES.values())
                line = ", ".join(f"{name} {ms:.3f} ms ({macs / ms / 1e6:.1f} GMAC/s)" for name, ms in best.items())
                ratio = f"; {best['against'] / best['this tree']:.2f}x" if "against" in best else ""
                print(f"{fmt}, {rows} row(s) per expert: {line}{ratio}")


if __name__ == "__main__":
    main()
