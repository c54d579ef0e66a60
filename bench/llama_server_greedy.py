"""llama-server's own step time for greedy streams sent as the gateway sends them, top-k off (0) vs top-k 1.

    .venv/bin/python bench/llama_server_greedy.py --streams 16 --tokens 32 --reps 4

Why the gateway sends greedy requests with top-k 1 (deltafin/engine/upstream/llama_server.py): the token is the
same, but with top-k off llama.cpp's final sampler softmaxes the whole vocabulary for every stream at every step.
Same prompt, same body otherwise (bench/gateway.py's `completion_body`), alternating which goes first.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gateway  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=4)
    args = parser.parse_args()

    from deltafin.engine.weights.tokenizer_only import load_tokenizer_only
    from deltafin.testing import compose_config

    tokenizer = load_tokenizer_only(compose_config().model).tokenizer
    rendered = tokenizer.apply_chat_template(gateway.PROMPT, add_generation_prompt=True, tokenize=True)
    prompt_ids = list(rendered["input_ids"] if isinstance(rendered, dict) else rendered)
    gateway_body = gateway.completion_body

    def body_with_top_k(top_k: int):
        def body(ids: list[int], tokens: int) -> dict:
            return {**gateway_body(ids, tokens), "top_k": top_k}

        return body

    process, url = gateway.start_upstream_llama_server(args.streams, threads=2)
    results: dict[int, list] = {0: [], 1: []}
    try:
        for rep in range(args.reps):
            for top_k in (0, 1) if rep % 2 == 0 else (1, 0):
                gateway.completion_body = body_with_top_k(top_k)
                results[top_k] += asyncio.run(gateway.burst(url, args.streams, args.tokens, prompt_ids))
    finally:
        process.kill()
    print(f"llama-server, {args.streams} greedy streams x {args.tokens} tokens, {args.reps} reps")
    for top_k, streams in results.items():
        steady = statistics.median(statistics.mean(gaps[len(gaps) // 2 :]) for _, gaps in streams)
        print(f"top-k {top_k}: inter-token median (second half of each stream) {steady * 1000:6.2f} ms")


if __name__ == "__main__":
    main()
