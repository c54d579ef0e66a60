"""What a native pass costs by the tokens it holds and the context before them: the price of a speculative guess.

    flock /tmp/deltafin-bench.lock .venv/bin/python bench/verify_pass.py [--contexts 64 450 900] [--tokens 1 2 4 8 16]

One row of the default GGUF through the native C step (deltafin/engine/kernels/llama_step.c) as the engine's
speculative step runs it (BatchKV.place, NativeForward.run, BatchKV.accept): after a cache of C tokens, its
pending token and T - 1 guesses in one pass, every position's logits, the first token kept (so the context grows
by one a pass, and the rejected columns are compacted away as in the engine); wall time, medians of `--reps`
passes. T = 1 is the decode step `none` runs. Per extra token: (pass(T_max) -
pass(1)) / (T_max - 1), and that as a share of a one-token pass: c, what the speculative planner prices a guess
at (deltafin/engine/local/speculative/cost.py measures it the same way in the engine). The one-token pass grows
with the context (its row's float32 keys and values are read from memory once a layer); extra tokens of the
same row read them again from the cache, so they add the matmuls' arithmetic and the attention's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deltafin.engine.kv.batch import BatchKV  # noqa: E402
from deltafin.engine.llama.native import NativeLlamaStep  # noqa: E402
from deltafin.engine.local.generator import prefill  # noqa: E402
from deltafin.engine.local.speculative.forward import NativeForward  # noqa: E402
from deltafin.engine.weights.loader import load_model  # noqa: E402
from deltafin.testing import compose_config  # noqa: E402


def pass_ms(forward: NativeForward, kv: BatchKV, tokens: int, reps: int) -> float:
    times = []
    for _ in range(reps):
        fed = torch.randint(100, 40000, (tokens,)).tolist()
        started = time.perf_counter()
        placement = kv.place([tokens], own_columns=True)
        forward.run(kv, [fed], placement)
        kv.accept(placement, [1])
        times.append(time.perf_counter() - started)
        if kv.holes:
            kv.compact()
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 450, 900])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--reps", type=int, default=12)
    args = parser.parse_args()
    config = compose_config()
    loaded = load_model(config.model, config.placement)
    forward = NativeForward(NativeLlamaStep(loaded.model))
    torch.manual_seed(0)
    print(f"torch threads {torch.get_num_threads()}, medians of {args.reps} passes")
    for context in args.contexts:
        cache = DynamicCache(config=loaded.model.config)
        prefill(loaded.model, torch.randint(100, 40000, (context,)).tolist(), cache, 0)
        kv = BatchKV(torch.device("cpu"))
        kv.add(cache, context)
        times = {tokens: pass_ms(forward, kv, tokens, args.reps) for tokens in args.tokens}
        one, most = times[min(times)], max(times)
        extra = (times[most] - one) / (most - min(times))
        row = "  ".join(f"T={tokens} {ms:.2f} ms" for tokens, ms in times.items())
        print(f"context {context}: {row} | an extra token {extra:.2f} ms = {extra / one:.2f} of a one-token pass")


if __name__ == "__main__":
    main()
