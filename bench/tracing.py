"""What tracing costs decode throughput: the default config with `server.tracing` off and on, side by side in
one run.

    flock /tmp/deltafin-bench.lock .venv/bin/python bench/tracing.py [--rounds 5] [--tokens 128] [--streams 8]

Two servers of the default model (memo off): one without tracing, one tracing every request (sample_ratio 1,
each request bringing a sampled W3C traceparent) to a local OTLP/HTTP receiver in this process, which reads and
drops what it gets. Each round runs, on one server then the other (the order alternates between rounds, only
one server busy at a time):
- decode, 1 stream: one greedy chat request, `ignore_eos`, exactly `--tokens` new tokens; completion tokens over
  the request's wall time;
- aggregate, `--streams` concurrent clients of `--tokens // 2` tokens each; total completion tokens over the wall
  time from the first request to the last answer.
Prints the median of each over the rounds, and the traced server's over the untraced one's (1.0: no cost). The
receiver's count of spans shows the traced requests really were exported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from deltafin.testing import LiveServer  # noqa: E402

TOPICS = ["the sea", "a lighthouse", "mountains", "a city at night", "autumn", "a library", "the desert", "rain"]
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class Receiver:
    """An OTLP/HTTP collector that counts the bytes of each export and drops them."""

    def __init__(self) -> None:
        self.exports = 0
        self.bytes = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                receiver.bytes += len(self.rfile.read(int(self.headers["Content-Length"])))
                receiver.exports += 1
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


def chat(base_url: str, i: int, tokens: int) -> int:
    body = {
        "messages": [{"role": "user", "content": f"Write a detailed story about {TOPICS[i % len(TOPICS)]}."}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    response = httpx.post(
        f"{base_url}/v1/chat/completions", json=body, headers={"traceparent": TRACEPARENT}, timeout=600
    )
    response.raise_for_status()
    return response.json()["usage"]["completion_tokens"]


def single(base_url: str, tokens: int) -> float:
    started = time.perf_counter()
    produced = chat(base_url, 0, tokens)
    return produced / (time.perf_counter() - started)


def aggregate(base_url: str, streams: int, tokens: int) -> float:
    counts = [0] * streams

    def one(i: int) -> None:
        counts[i] = chat(base_url, i, tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(counts) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, default=8)
    args = parser.parse_args()
    receiver = Receiver()
    common = ["server.memo.entries=0", "server.queue.timeout_s=600", "server.queue.max_waiting=64"]
    servers = {
        "off": LiveServer(common),
        "on": LiveServer([*common, f"server.tracing.otlp_endpoint={receiver.url}"]),
    }
    try:
        for server in servers.values():
            server.wait_ready(timeout=600)
            chat(server.base_url, 0, 8)  # warm: first-request costs out of the figures
        results: dict[str, dict[str, list[float]]] = {name: {"single": [], "aggregate": []} for name in servers}
        for round_ in range(args.rounds):
            order = list(servers) if round_ % 2 == 0 else list(reversed(servers))
            for name in order:
                url = servers[name].base_url
                results[name]["single"].append(single(url, args.tokens))
                results[name]["aggregate"].append(aggregate(url, args.streams, args.tokens // 2))
        time.sleep(6)  # the traced server's batch processor exports every 5 s
        print(f"rounds {args.rounds}, {args.tokens} tokens (1 stream), {args.streams} x {args.tokens // 2} tokens")
        for measure in ("single", "aggregate"):
            off = statistics.median(results["off"][measure])
            on = statistics.median(results["on"][measure])
            print(f"{measure:10s} off {off:7.1f} tok/s   on {on:7.1f} tok/s   on/off {on / off:.3f}")
            print(f"{'':10s} off rounds {[round(x, 1) for x in results['off'][measure]]}")
            print(f"{'':10s} on rounds  {[round(x, 1) for x in results['on'][measure]]}")
        print(f"receiver: {receiver.exports} exports, {receiver.bytes} bytes")
    finally:
        for server in servers.values():
            server.stop()


if __name__ == "__main__":
    main()
