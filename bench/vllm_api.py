"""vLLM's two token-id endpoints side by side: `/inference/v1/generate` (`--enable-scale-out`) and `/v1/completions`
with a token-id prompt, each behind its own Deltafin gateway (`engine.api=generate` / `completions`), same vLLM.

    .venv/bin/python bench/vllm_api.py --streams 16 --tokens 64 --reps 3

The served model is the tiny Qwen3 of the vLLM tier with 32-wide heads (its weights untaught: the streams ignore
EOS, so only the shapes matter), so the model's own compute is small and what differs, vLLM's per-token work outside the model (detokenizing, building OpenAI chunks), shows.
Greedy streams with `ignore_eos`, both gateways alternately first; prints the wall time of each burst.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deltafin.testing import TINY_OVERRIDES, TINY_SPECS, LiveServer  # noqa: E402
from deltafin.testing.vllm_server import VllmServer, stream_chat  # noqa: E402
from deltafin.tiny import write_tiny_model  # noqa: E402
from deltafin.tiny.taught import reshape_heads  # noqa: E402


async def burst(url: str, streams: int, tokens: int) -> float:
    started = time.monotonic()
    results = await asyncio.gather(*(stream_chat(url, f"Question {i}?", tokens) for i in range(streams)))
    assert all(r[:4] == (200, tokens, "length", None) for r in results), results
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    family, variant = TINY_SPECS["qwen3"]
    model = write_tiny_model(family, Path(tempfile.mkdtemp()) / "qwen3", variant=variant)
    reshape_heads(model, 32)  # vLLM's CPU attention takes heads of 32 and up
    vllm = VllmServer(model, name="tiny-qwen3", max_model_len=1024, args=("--enable-scale-out",))
    gateways = {}
    try:
        vllm.wait_ready()
        for api in ("generate", "completions"):
            gateways[api] = LiveServer(
                [
                    *TINY_OVERRIDES["qwen3"],
                    f"model.path={model}",
                    "engine=vllm",
                    f"engine.url={vllm.url}",
                    f"engine.api={api}",
                    "server.memo.entries=0",
                ]
            )
        for server in gateways.values():
            server.wait_ready()
            asyncio.run(burst(server.base_url, 2, 4))  # warm
        times: dict[str, list[float]] = {api: [] for api in gateways}
        for rep in range(args.reps):
            for api in ("generate", "completions") if rep % 2 == 0 else ("completions", "generate"):
                times[api].append(asyncio.run(burst(gateways[api].base_url, args.streams, args.tokens)))
        print(f"vLLM (tiny Qwen3), {args.streams} streams x {args.tokens} tokens, {args.reps} reps, median burst:")
        for api, values in times.items():
            median = statistics.median(values)
            print(
                f"  engine.api={api:11s} {median:6.2f} s  ({args.streams * args.tokens / median:6.1f} tok/s; "
                f"all: {', '.join(f'{v:.2f}' for v in values)})"
            )
    finally:
        for server in gateways.values():
            server.stop()
        vllm.stop()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
