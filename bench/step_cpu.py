"""CPU time of one decode step, side by side in one process: the native GGUF step (the default) against the
fused torch step on the dequantized float32 weights (the previous default) and on `placement.quantize=int8`.

    .venv/bin/python bench/step_cpu.py [--rows 1 8] [--steps 32] [--threads 1]

CPU time (this process's, `time.process_time`) rather than wall time: on a machine shared with other jobs the
wall time of a step measures the scheduler; the CPU a step costs is what it would take on a quiet machine
(memory and cache contention still inflate it). With one thread that is the step's own cost; medians over
`--steps` steps after a short prompt, the variants interleaved step by step so they see the same load.
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
from deltafin.engine.local.generator import prefill  # noqa: E402
from deltafin.engine.local.steps import decode_step_for
from deltafin.engine.weights.loader import load_model  # noqa: E402
from deltafin.testing import compose_config  # noqa: E402

PROMPT = "Write a detailed story about a lighthouse keeper and the sea."


def batch(loaded, rows: int):
    ids = loaded.tokenizer(PROMPT).input_ids
    kv = BatchKV(torch.device("cpu"))
    cache = DynamicCache(config=loaded.model.config)
    logits, _ = prefill(loaded.model, ids, cache, 0)
    kv.add(cache, len(ids), copies=rows)
    return kv, torch.full((rows, 1), int(logits.argmax()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    variants = {
        "native GGUF (default)": [],
        "fused float32": ["model.gguf_weights=dequantize"],
        "fused int8": ["placement.quantize=int8"],
    }
    models = {}
    for name, overrides in variants.items():
        config = compose_config(overrides)
        loaded = load_model(config.model, config.placement)
        models[name] = (loaded, decode_step_for(loaded.model))
    with torch.inference_mode():
        for rows in args.rows:
            state = {name: batch(loaded, rows) for name, (loaded, _) in models.items()}
            cpu = {name: [] for name in models}
            for _ in range(args.steps):
                for name, (loaded, step) in models.items():
                    kv, tokens = state[name]
                    mask, positions = kv.step_inputs()
                    started = time.process_time()
                    logits = step(loaded.model, tokens, mask, positions, kv.cache)
                    cpu[name].append(time.process_time() - started)
                    kv.advanced(mask)
                    state[name] = (kv, logits.argmax(-1, keepdim=True))
            base = statistics.median(cpu["native GGUF (default)"])
            for name, times in cpu.items():
                median = statistics.median(times)
                print(f"rows {rows}: {name:24s} {median * 1000:7.2f} ms CPU a step ({median / base:.2f}x native)")


if __name__ == "__main__":
    main()
