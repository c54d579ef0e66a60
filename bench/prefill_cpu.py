"""CPU time of one new prompt's prefill on the default model, in this process: the cost a fresh prompt's TTFT is
made of, without the server around it.

    .venv/bin/python bench/prefill_cpu.py [--tokens 1024] [--reps 2] [--threads 1] [Hydra overrides ...]

CPU time (`time.process_time`) rather than wall time, one torch thread by default: on a machine shared with other
jobs it is the prefill's own cost. The prompt is a repeated sentence cut to `--tokens` tokens, prefilled in the
engine's windows (`engine.prefill_chunk_tokens` of the composed config) into a new cache each repetition. To
compare two versions of the code, run the script from a worktree of each, alternating.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from deltafin.engine.local.generator import prefill  # noqa: E402
from deltafin.engine.weights.loader import load_model  # noqa: E402
from deltafin.testing import compose_config  # noqa: E402

TEXT = "The lighthouse keeper walked along the shore, counting the waves and the gulls. " * 2000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args, overrides = parser.parse_known_args()
    torch.set_num_threads(args.threads)
    config = compose_config(overrides)
    loaded = load_model(config.model, config.placement)
    ids = loaded.tokenizer(TEXT).input_ids[: args.tokens]
    with torch.inference_mode():
        for _ in range(args.reps):
            cache = DynamicCache(config=loaded.model.config)
            started, wall = time.process_time(), time.perf_counter()
            prefill(loaded.model, ids, cache, 0, chunk=config.engine.prefill_chunk_tokens)
            print(
                f"{len(ids)} tokens: cpu {time.process_time() - started:.2f} s, wall {time.perf_counter() - wall:.2f} s",
                flush=True,
            )


if __name__ == "__main__":
    main()
