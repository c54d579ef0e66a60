"""Deltafin vs transformers' `generate` on the same weights, dtype and prompt, measured in one run.

    .venv/bin/python bench/decode.py [--tokens 128] [--reps 3]

Prints, as ratios and deltas measured side by side:
- decode tokens/s through Deltafin's streaming chat API over `model.generate` (greedy, fixed length);
- server time to first token (client side, HTTP included) minus the engine's prefill time for that prompt;
- memo-hit latency of an identical deterministic request.
The server runs as a real process (`python -m deltafin`); memo and prefix cache are off for the decode and
TTFT runs (so every run prefills and decodes for real) and on, in a second server, for the memo run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from deltafin.engine.weights.loader import load_model  # noqa: E402
from deltafin.testing import LiveServer, compose_config  # noqa: E402

MESSAGES = [{"role": "user", "content": "Write a detailed story about a lighthouse keeper and the sea."}]


def stream_chat(base_url: str, max_tokens: int) -> tuple[float, list[float]]:
    """Returns (seconds to the first content chunk, arrival times of every content chunk)."""
    body = {"messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    arrivals: list[float] = []
    started = time.perf_counter()
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if line.startswith("data: {") and '"content":"' in line and '"role"' not in line:
                arrivals.append(time.perf_counter())
    return arrivals[0] - started, arrivals


def bench_generate(model, ids: torch.Tensor, tokens: int) -> tuple[float, float]:
    """(prefill seconds, decode tokens/s) of `generate`, greedy, exactly `tokens` new tokens."""
    kwargs = dict(do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        started = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        one = time.perf_counter() - started
        started = time.perf_counter()
        model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **kwargs)
        full = time.perf_counter() - started
    return one, (tokens - 1) / (full - one)


def engine_prefill(model, ids: torch.Tensor) -> float:
    with torch.inference_mode():
        started = time.perf_counter()
        model(input_ids=ids, use_cache=True, logits_to_keep=1)
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()

    config = compose_config()
    loaded = load_model(config.model, config.placement)
    ids = loaded.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    ids = torch.tensor([ids["input_ids"] if hasattr(ids, "keys") else ids])

    server = LiveServer(["server.memo.entries=0", "server.prefix_cache.enabled=false"])
    try:
        server.wait_ready()
        stream_chat(server.base_url, 8)  # warm-up
        bench_generate(loaded.model, ids, 8)
        hf_rates, df_rates, prefills, ttfts = [], [], [], []
        for _ in range(args.reps):
            _, hf_rate = bench_generate(loaded.model, ids, args.tokens)
            hf_rates.append(hf_rate)
            prefills.append(engine_prefill(loaded.model, ids))
            ttft, arrivals = stream_chat(server.base_url, args.tokens)
            ttfts.append(ttft)
            # Chunks may merge tokens (held-back bytes); count tokens from the usage we asked for.
            df_rates.append((args.tokens - 1) / (arrivals[-1] - arrivals[0]))
        # The server's own view of the same requests: TTFT from request arrival vs the engine's prefill.
        # The log file also holds stderr (a progress bar without a newline can prefix a line): JSON lines only.
        logged = [
            json.loads(line) for line in server.log_lines() if line.startswith("{") and '"event": "request"' in line
        ]
        overheads = [
            entry["ttft_ms"] - entry["prefill_ms"]
            for entry in logged
            if entry["route"] == "/v1/chat/completions" and entry["completion_tokens"] == args.tokens
        ]
    finally:
        server.stop()

    memo_server = LiveServer([])
    try:
        memo_server.wait_ready()
        body = {"messages": MESSAGES, "max_tokens": args.tokens, "temperature": 0}
        cold_started = time.perf_counter()
        httpx.post(f"{memo_server.base_url}/v1/chat/completions", json=body, timeout=300).raise_for_status()
        cold = time.perf_counter() - cold_started
        hits = []
        for _ in range(5):
            started = time.perf_counter()
            httpx.post(f"{memo_server.base_url}/v1/chat/completions", json=body, timeout=300).raise_for_status()
            hits.append(time.perf_counter() - started)
    finally:
        memo_server.stop()

    hf, df = statistics.median(hf_rates), statistics.median(df_rates)
    prefill, ttft = statistics.median(prefills), statistics.median(ttfts)
    print(
        f"prompt tokens: {ids.shape[1]}, new tokens: {args.tokens}, reps: {args.reps}, torch threads: {torch.get_num_threads()}"
    )
    print(f"transformers generate decode: {hf:.1f} tok/s")
    print(f"deltafin streaming decode:    {df:.1f} tok/s")
    print(f"decode ratio deltafin/generate: {df / hf:.3f}x")
    print(f"server TTFT minus the engine's prefill, same requests (server log): {statistics.median(overheads):.1f} ms")
    print(
        f"client-side TTFT over HTTP: {ttft * 1000:.1f} ms; prefill of the same prompt in this process: "
        f"{prefill * 1000:.1f} ms"
    )
    print(
        f"memo: cold request {cold * 1000:.1f} ms, hit {statistics.median(hits) * 1000:.1f} ms "
        f"({cold / statistics.median(hits):.0f}x faster)"
    )


if __name__ == "__main__":
    main()
