"""Aggregate throughput under concurrency: Deltafin (continuous batching) vs transformers `generate` vs
`llama-server -np 8` on the same GGUF, measured in one run.

    .venv/bin/python bench/throughput.py [--tokens 64] [--streams 1 4 8]

Prints, side by side:
- aggregate decode tok/s at 1, 4, 8 concurrent clients through the real HTTP server (chat, greedy,
  `ignore_eos`, `max_tokens` exact), and the ratio of 8 streams to Deltafin's own single stream;
- transformers `generate` on a left-padded batch of the same prompts (same weights, in this process);
- llama-server with `-np 8` on the same GGUF file when its binary is present (scripts/build-llama-server);
- single-stream rate with `placement.quantize=int8` over llama.cpp's single stream (its Q4_1 weights);
- TTFT of a new request while 7 others decode, against its own prefill plus two decode steps of the batch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.conftest import LiveServer, compose_config  # noqa: E402
from tests.llama_server import llama_server_binary, start_llama_server  # noqa: E402

from deltafin.engine.loader import load_model, resolve_model_path  # noqa: E402

TOPICS = ["the sea", "a lighthouse", "mountains", "a city at night", "autumn", "a library", "the desert", "rain"]
LLAMA_SERVER = llama_server_binary()


def messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Write a detailed story about {TOPICS[i % len(TOPICS)]}."}]


def chat(base_url: str, i: int, tokens: int, extra: dict | None = None) -> int:
    body = {"messages": messages(i), "max_tokens": tokens, "temperature": 0, "ignore_eos": True, **(extra or {})}
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=600)
    response.raise_for_status()
    return response.json()["usage"]["completion_tokens"]


def aggregate(base_url: str, streams: int, tokens: int, extra: dict | None = None) -> float:
    """Total completion tokens over wall time, `streams` clients at once (each one request)."""
    counts = [0] * streams

    def client(i: int) -> None:
        counts[i] = chat(base_url, i, tokens, extra)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(streams)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(counts) / (time.perf_counter() - started)


def generate_rate(loaded, streams: int, tokens: int) -> float:
    """transformers `generate`, greedy, a left-padded batch of the same prompts, exactly `tokens` new tokens."""
    tok = loaded.tokenizer
    tok.padding_side = "left"
    texts = [tok.apply_chat_template(messages(i), add_generation_prompt=True, tokenize=False) for i in range(streams)]
    batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.inference_mode():
        started = time.perf_counter()
        loaded.model.generate(**batch, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                              pad_token_id=tok.pad_token_id or 0)
    return streams * tokens / (time.perf_counter() - started)


def ttft_beside_seven(server: LiveServer, tokens: int) -> tuple[float, float, float]:
    """(TTFT ms of a new request while 7 decode, its prefill ms, the batch's decode step ms), server-side."""
    gaps: list[float] = []
    done = threading.Event()

    def long_stream(i: int) -> None:
        body = {"messages": messages(i), "max_tokens": tokens * 4, "temperature": 0, "ignore_eos": True, "stream": True}
        last = None
        with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=600) as response:
            for line in response.iter_lines():
                if done.is_set():
                    break  # leaving closes the connection: the server cancels the row
                if line.startswith("data: {"):
                    now = time.perf_counter()
                    if last is not None and i == 0:
                        gaps.append(now - last)
                    last = now

    threads = [threading.Thread(target=long_stream, args=(i,)) for i in range(7)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    while len(gaps) < 10:  # the seven are decoding together
        time.sleep(0.1)
    request_id = uuid.uuid4().hex
    body = {"messages": messages(7), "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=600,
                      headers={"x-request-id": request_id}) as response:
        for _ in response.iter_lines():
            pass
    step_ms = statistics.median(gaps[-10:]) * 1000
    done.set()
    for thread in threads:
        thread.join()
    entry = server.request_log(request_id)
    return entry["ttft_ms"], entry["prefill_ms"], step_ms


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 8])
    args = parser.parse_args()
    config = compose_config()
    loaded = load_model(config.model, config.placement)
    threads = torch.get_num_threads()
    rows: dict[str, dict[int, float]] = {}

    server = LiveServer(["server.memo.entries=0", "server.queue.timeout_s=600", "server.queue.max_waiting=64"])
    try:
        server.wait_ready()
        chat(server.base_url, 0, 4)  # warm-up
        rows["deltafin"] = {n: aggregate(server.base_url, n, args.tokens) for n in args.streams}
        print("measured:", rows, flush=True)
        ttft, prefill, step = ttft_beside_seven(server, args.tokens)
    finally:
        server.stop()
    rows["transformers generate (padded batch)"] = {n: generate_rate(loaded, n, args.tokens) for n in args.streams}
    print("measured:", rows, flush=True)

    for mode in ("int8", "int4"):
        quantized = LiveServer(["server.memo.entries=0", f"placement.quantize={mode}"])
        try:
            quantized.wait_ready()
            chat(quantized.base_url, 0, 4)
            rows[f"deltafin {mode}"] = {1: aggregate(quantized.base_url, 1, args.tokens)}
        finally:
            quantized.stop()

    if LLAMA_SERVER.exists():
        process, base = start_llama_server(resolve_model_path(config.model.path), parallel=8, context=8192,
                                           threads=threads)
        try:
            chat(base, 0, 4)
            rows["llama-server -np 8 (Q4_1)"] = {n: aggregate(base, n, args.tokens) for n in args.streams}
        finally:
            process.terminate()
            process.wait(timeout=15)

    print(f"new tokens per request: {args.tokens}, torch threads: {threads}, load average: {os.getloadavg()[0]:.1f}")
    print("aggregate tok/s by concurrent streams: " + json.dumps({k: {n: round(v, 1) for n, v in r.items()}
                                                                    for k, r in rows.items()}))
    own = rows["deltafin"]
    if 8 in own and 1 in own:
        print(f"deltafin 8 streams / 1 stream: {own[8] / own[1]:.2f}x (target >= 2.5x)")
    if 8 in own:
        print(f"deltafin / generate at 8 streams: {own[8] / rows['transformers generate (padded batch)'][8]:.2f}x")
    llama = rows.get("llama-server -np 8 (Q4_1)")
    if llama:
        for n in args.streams:
            print(f"deltafin / llama-server at {n} streams: {own[n] / llama[n]:.2f}x")
        print(f"deltafin int8 single stream / llama-server Q4_1 single stream: "
              f"{rows['deltafin int8'][1] / llama[1]:.2f}x (target >= 0.5x); int4: {rows['deltafin int4'][1] / llama[1]:.2f}x; "
              f"float32: {own[1] / llama[1]:.2f}x")
    print(f"TTFT of a new request beside 7 decoding: {ttft:.0f} ms; its prefill {prefill:.0f} ms + 2 steps of "
          f"{step:.0f} ms = {prefill + 2 * step:.0f} ms (target: TTFT <= that)")


if __name__ == "__main__":
    main()
