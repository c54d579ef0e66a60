"""int8 weight-only kernels at decode-step sizes, side by side in one run: Deltafin's C kernel, torch's
`_weight_int8pack_mm` (bfloat16 activations) and fbgemm's dynamic int8 GEMM, over matrices of the default
model's shapes (30 layers of q/k/v, o, gate/up, down, plus the LM head: 134 MB of int8, too big for any cache).

    .venv/bin/python bench/int8_kernels.py --rows 1 2 8 --reps 4
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

from deltafin.engine.kernels import int8_matvec

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def timed(run, repeat: int = 10) -> float:
    run()
    started = time.perf_counter()
    for _ in range(repeat):
        run()
    return (time.perf_counter() - started) / repeat * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8])
    parser.add_argument("--reps", type=int, default=4)
    args = parser.parse_args()
    kernel = int8_matvec()
    assert kernel is not None, "no C compiler: the C kernel could not be built"
    weights = [(torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n) / 100) for n, k in SHAPES]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated; fbgemm is here for comparison only
        packed = [
            torch.ops.quantized.linear_prepack(
                torch._make_per_channel_quantized_tensor(w, s.double(), torch.zeros(w.shape[0], dtype=torch.long), 0),
                None,
            )
            for w, s in weights
        ]
    megabytes = sum(n * k for n, k in SHAPES) / 1e6
    print(f"{len(SHAPES)} matrices, {megabytes:.0f} MB of int8, torch threads {torch.get_num_threads()}")
    for rows in args.rows:
        x = {k: torch.randn(rows, k) for k in (576, 1536)}
        xb = {k: v.bfloat16() for k, v in x.items()}
        kernels = {
            "deltafin C kernel": lambda: [kernel(x[w.shape[1]], w, s, None) for w, s in weights],
            "torch _weight_int8pack_mm": lambda: [
                torch.ops.aten._weight_int8pack_mm(xb[w.shape[1]], w, s.bfloat16()) for w, s in weights
            ],
            "fbgemm linear_dynamic": lambda: [
                torch.ops.quantized.linear_dynamic(x[w.shape[1]], p, True) for (w, _), p in zip(weights, packed)
            ],
        }
        best = {name: min(timed(run) for _ in range(args.reps)) for name, run in kernels.items()}
        for name, ms in best.items():
            print(f"rows {rows}: {name:28s} {ms:6.2f} ms  {megabytes / ms:5.1f} GB/s")


if __name__ == "__main__":
    main()
