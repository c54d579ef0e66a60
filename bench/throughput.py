"""The default config against `llama-server -np 8` on the same GGUF, side by side in one run (the
default's figures against it), plus optional extras.

    .venv/bin/python bench/throughput.py [--single-tokens 128] [--tokens 64] [--streams 8] [--extras]

Prints, for the DEFAULT Deltafin config (the GGUF's own blocks, `python -m deltafin` with the memo off) and for
llama-server (its binary from scripts/build-llama-server; `-np 8 -c 16384`: 2048 positions a slot, room for the
long prompt) on the same GGUF file, each through its HTTP chat endpoint:
- decode, 1 stream: one greedy chat request, `ignore_eos`, exactly `--single-tokens` new tokens; completion
  tokens over the wall time of the request (prefill of a short prompt included, as for both);
- aggregate, `--streams` concurrent clients of `--tokens` tokens each (different prompts): total completion
  tokens over the wall time from the first request to the last answer;
- TTFT of a repeated ~1.1k-token prompt: streamed, client side (request sent to the first content chunk),
  median of 5 after one warm-up; both servers reuse the prompt's KV cache (prefix cache / `cache_prompt`);
- TTFT of a new prompt (`--fresh-copies` copies of the same notes, each request's message starting with a new
  word): median of 3, the whole prompt prefilled each time.
With `--extras`: aggregate at 1 and 4 streams, transformers `generate` on a padded batch (dequantized float32,
in this process), `placement.quantize=int8` / `int4` single streams (on the dequantized weights), and the TTFT of
a new request beside 7 decoding.
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

from deltafin.engine.weights.loader import load_model, resolve_model_path  # noqa: E402
from deltafin.testing import LiveServer, compose_config  # noqa: E402
from deltafin.testing.llama_server import llama_server_binary, start_llama_server  # noqa: E402

TOPICS = ["the sea", "a lighthouse", "mountains", "a city at night", "autumn", "a library", "the desert", "rain"]
#: ~1.1k tokens of SmolLM2's tokenizer
LONG_PROMPT = "Summarize the following notes in one sentence.\n" + " ".join(
    f"Note {i}: the harbour master logged ship number {i * 7} arriving at dawn with {i % 5 + 2} crates of tea, "
    f"and the weather was {['calm', 'windy', 'foggy', 'rainy'][i % 4]}."
    for i in range(34)
)
LLAMA_SERVER = llama_server_binary()


def messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Write a detailed story about {TOPICS[i % len(TOPICS)]}."}]


def chat(base_url: str, i: int, tokens: int, extra: dict | None = None) -> int:
    body = {"messages": messages(i), "max_tokens": tokens, "temperature": 0, "ignore_eos": True, **(extra or {})}
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=600)
    response.raise_for_status()
    return response.json()["usage"]["completion_tokens"]


def ttft(base_url: str, content: str, reps: int = 5, fresh: bool = False) -> tuple[float, int]:
    """(median seconds from sending a streamed chat request to its first content chunk, prompt tokens); the
    first request warms the server's cache of this prompt. `fresh`: every request's user message starts with
    a new word instead, so only the chat template's short system preamble can come from a cache: the whole
    prompt is prefilled each time."""

    def body() -> dict:
        text = f"Request {uuid.uuid4().hex[:8]}. {content}" if fresh else content
        return {"messages": [{"role": "user", "content": text}], "max_tokens": 4, "temperature": 0}

    warm = httpx.post(f"{base_url}/v1/chat/completions", json=body(), timeout=600)
    warm.raise_for_status()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        with httpx.stream(
            "POST", f"{base_url}/v1/chat/completions", json={**body(), "stream": True}, timeout=600
        ) as response:
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                    times.append(time.perf_counter() - started)
                    break
            for _ in lines:
                pass
    return statistics.median(times), warm.json()["usage"]["prompt_tokens"]


def side(base_url: str, args: argparse.Namespace, streams: list[int]) -> dict[str, float]:
    """The three figures against llama-server (and `streams` aggregates) for one server."""
    chat(base_url, 0, 4)  # warm-up
    out = {"single": aggregate(base_url, 1, args.single_tokens)}
    for n in streams:
        out[f"{n} streams"] = aggregate(base_url, n, args.tokens)
    out["ttft_s"], out["prompt_tokens"] = ttft(base_url, LONG_PROMPT)
    out["fresh_ttft_s"], out["fresh_prompt_tokens"] = ttft(
        base_url, LONG_PROMPT * args.fresh_copies, reps=3, fresh=True
    )
    return out


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
        loaded.model.generate(
            **batch, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=tok.pad_token_id or 0
        )
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
    with httpx.stream(
        "POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=600, headers={"x-request-id": request_id}
    ) as response:
        for _ in response.iter_lines():
            pass
    step_ms = statistics.median(gaps[-10:]) * 1000
    done.set()
    for thread in threads:
        thread.join()
    entry = server.request_log(request_id)
    return entry["ttft_ms"], entry["prefill_ms"], step_ms


def extras(args: argparse.Namespace, rows: dict) -> None:
    """The figures of earlier runs: generate, int8 / int4, TTFT beside seven."""
    config = compose_config(["model.gguf_weights=dequantize"])
    loaded = load_model(config.model, config.placement)
    rows["transformers generate (padded batch, float32)"] = {
        n: generate_rate(loaded, n, args.tokens) for n in (1, 4, args.streams)
    }
    for mode in ("int8", "int4"):
        quantized = LiveServer(["server.memo.entries=0", f"placement.quantize={mode}"])
        try:
            quantized.wait_ready()
            chat(quantized.base_url, 0, 4)
            rows[f"deltafin {mode}"] = {"single": aggregate(quantized.base_url, 1, args.single_tokens)}
        finally:
            quantized.stop()
    server = LiveServer(["server.memo.entries=0", "server.queue.timeout_s=600", "server.queue.max_waiting=64"])
    try:
        server.wait_ready()
        chat(server.base_url, 0, 4)
        ttft_ms, prefill, step = ttft_beside_seven(server, args.tokens)
        rows["deltafin: TTFT beside 7 decoding"] = {"ttft_ms": ttft_ms, "prefill_ms": prefill, "step_ms": step}
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--single-tokens", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--extras", action="store_true", help="generate, int8/int4, TTFT beside seven")
    parser.add_argument(
        "--fresh-copies",
        type=int,
        default=1,
        help="the new-prompt TTFT's prompt: this many copies of the ~1.1k-token notes",
    )
    args = parser.parse_args()
    config = compose_config()
    threads = torch.get_num_threads()
    streams = [1, 4, args.streams] if args.extras else [args.streams]
    rows: dict[str, dict] = {}

    server = LiveServer(["server.memo.entries=0", "server.queue.timeout_s=600", "server.queue.max_waiting=64"])
    try:
        server.wait_ready()
        rows["deltafin (default)"] = side(server.base_url, args, streams)
    finally:
        server.stop()
    print("measured:", rows, flush=True)
    if LLAMA_SERVER.exists():
        process, base = start_llama_server(
            resolve_model_path(config.model.path), parallel=args.streams, context=16384, threads=threads, ready_s=600
        )
        try:
            rows["llama-server -np 8"] = side(base, args, streams)
        finally:
            process.terminate()
            process.wait(timeout=15)
    else:
        print(f"llama-server not found at {LLAMA_SERVER} (scripts/build-llama-server): no comparison")
    if args.extras:
        extras(args, rows)

    print(
        f"single stream {args.single_tokens} tokens, {args.streams} streams x {args.tokens} tokens, "
        f"torch threads: {threads}, load average: {os.getloadavg()[0]:.1f}"
    )
    print(
        "figures: "
        + json.dumps(
            {k: {n: round(v, 4 if n.endswith("ttft_s") else 1) for n, v in r.items()} for k, r in rows.items()}
        )
    )
    own, llama = rows["deltafin (default)"], rows.get("llama-server -np 8")
    if llama:
        print(
            f"decode, 1 stream: deltafin {own['single']:.1f} tok/s, llama-server {llama['single']:.1f}: "
            f"{own['single'] / llama['single']:.2f}x (target >= 1.0x)"
        )
        key = f"{args.streams} streams"
        print(
            f"aggregate, {key}: deltafin {own[key]:.1f} tok/s, llama-server {llama[key]:.1f}: "
            f"{own[key] / llama[key]:.2f}x (target >= 1.5x)"
        )
        print(
            f"TTFT, repeated {own['prompt_tokens']:.0f}-token prompt: deltafin {own['ttft_s'] * 1000:.1f} ms, "
            f"llama-server {llama['ttft_s'] * 1000:.1f} ms: {own['ttft_s'] / llama['ttft_s']:.2f}x (target <= 1.0x)"
        )
        print(
            f"TTFT, new {own['fresh_prompt_tokens']:.0f}-token prompt: deltafin {own['fresh_ttft_s'] * 1000:.1f} ms, "
            f"llama-server {llama['fresh_ttft_s'] * 1000:.1f} ms: {own['fresh_ttft_s'] / llama['fresh_ttft_s']:.2f}x"
        )


if __name__ == "__main__":
    main()
