"""What a native pass costs by the tokens it holds and the context before them: the price of a speculative guess.

    flock /tmp/deltafin-bench.lock .venv/bin/python bench/verify_pass.py [--contexts 64 450 900] [--tokens 1 2 4 8 16]

One row of the default GGUF through the native C step (deltafin/engine/kernels/llama_step.c): after a cache of C
tokens, a window of T tokens (a speculative draft is checked as such a window), every position's logits, the
cache cut back to C after each pass; wall time, medians of `--reps` passes. Per extra token: (pass(T_max) -
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

from deltafin.engine.llama.native import NativeLlamaStep  # noqa: E402
from deltafin.engine.weights.loader import load_model  # noqa: E402
from deltafin.testing import compose_config  # noqa: E402


def pass_ms(step: NativeLlamaStep, cache: DynamicCache, tokens: int, reps: int) -> float:
    times = []
    for _ in range(reps):
        window = torch.randint(100, 40000, (tokens,))
        started = time.perf_counter()
        step.prefill(window, cache, 0)
        times.append(time.perf_counter() - started)
        cache.crop(-tokens)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 450, 900])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--reps", type=int, default=12)
    args = parser.parse_args()
    config = compose_config()
    loaded = load_model(config.model, config.placement)
    step = NativeLlamaStep(loaded.model)
    torch.manual_seed(0)
    print(f"torch threads {torch.get_num_threads()}, medians of {args.reps} passes")
    for context in args.contexts:
        cache = DynamicCache(config=loaded.model.config)
        step.prefill(torch.randint(100, 40000, (context,)), cache, 1)
        times = {tokens: pass_ms(step, cache, tokens, args.reps) for tokens in args.tokens}
        one, most = times[min(times)], max(times)
        extra = (times[most] - one) / (most - min(times))
        row = "  ".join(f"T={tokens} {ms:.2f} ms" for tokens, ms in times.items())
        print(f"context {context}: {row} | an extra token {extra:.2f} ms = {extra / one:.2f} of a one-token pass")


if __name__ == "__main__":
    main()
