"""The decode step eager (fused) vs its static-shape compiled form, in one process, on the default model.

    .venv/bin/python bench/compile_step.py [--quantize int8] [--rows 1] [--steps 48] [--backend inductor]

Prints the compiled step's first call (compilation included) and the median step of each (eager run
before and after the compiled one), greedy, after a
short prompt, one bucket pair throughout (the steps stay within one capacity bucket).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from deltafin.engine.kv.batch import BatchKV  # noqa: E402
from deltafin.engine.llama.fused import fused_llama_step  # noqa: E402
from deltafin.engine.llama.fused_static import StaticFusedStep  # noqa: E402
from deltafin.engine.local.generator import prefill  # noqa: E402
from deltafin.engine.weights.loader import load_model  # noqa: E402
from deltafin.testing import compose_config  # noqa: E402

PROMPT = "Write a detailed story about a lighthouse keeper and the sea. Once upon a time, on a rocky island far"


def run(model, ids: list[int], step, rows: int, steps: int) -> tuple[list[float], list[list[int]]]:
    """Seconds of every step and the greedy tokens."""
    kv = BatchKV(torch.device("cpu"))
    times, out = [], []
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        logits, _ = prefill(model, ids, cache, 0)
        kv.add(cache, len(ids), copies=rows)
        tokens = logits.argmax().view(1, 1).repeat(rows, 1)
        for _ in range(steps):
            mask, positions = kv.step_inputs()
            started = time.perf_counter()
            tokens = step(model, tokens, mask, positions, kv.cache).argmax(-1, keepdim=True)
            times.append(time.perf_counter() - started)
            kv.advanced(mask)
            out.append(tokens[:, 0].tolist())
    return times, out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quantize", default="int8")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args()
    loaded = load_model(compose_config().model, compose_config([f"placement.quantize={args.quantize}"]).placement)
    model = loaded.model
    ids = loaded.tokenizer(PROMPT).input_ids
    fused = fused_llama_step(model)
    static = StaticFusedStep(fused, backend=args.backend)
    before, eager_tokens = run(model, ids, fused, args.rows, args.steps)
    static_times, static_tokens = run(model, ids, static, args.rows, args.steps)
    after, _ = run(model, ids, fused, args.rows, args.steps)
    print(
        f"prompt {len(ids)} tokens, rows {args.rows}, {args.steps} steps, {args.quantize}, {args.backend}, "
        f"threads {torch.get_num_threads()}, buckets {sorted(static.graphs)}"
    )
    print(f"compiled first step (compilation): {static_times[0]:.1f} s")
    print(
        f"median step: eager fused {statistics.median(before) * 1000:.2f} ms before, "
        f"{statistics.median(after) * 1000:.2f} ms after; static compiled "
        f"{statistics.median(static_times[1:]) * 1000:.2f} ms"
    )
    print(f"same greedy tokens: {eager_tokens == static_tokens}")


if __name__ == "__main__":
    main()
