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
  time from the first request to the last answer;
and, for each, the server process's CPU time per 1000 completion tokens (/proc: all its threads, the exporter's
included), which a busy shared machine disturbs far less than wall time.
Prints, for each measure, the median over the rounds of the traced server's figure over the untraced one's taken
next to it (1.0: no cost; pairs cancel the drift of a shared machine's load), with the spread of those ratios. The
receiver's count of exports shows the traced requests really were exported.

Then, in this process, what tracing itself costs a request, in CPU time (this thread and the SDK's exporting
thread, `time.process_time`): `RequestTracer.start` and `finish` of a request like the aggregate's (a queue mark,
a prefill of 4 chunks, 8 decodes), spans exported over OTLP/HTTP to the receiver, per request, against the CPU the
same process spends idle (the difference is tracing's). That cost is per request, never per token.
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


def cpu_seconds(pid: int) -> float:
    """The process's user + system CPU time so far (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def single(base_url: str, tokens: int) -> tuple[int, float]:
    """(completion tokens, wall seconds) of one request."""
    started = time.perf_counter()
    produced = chat(base_url, 0, tokens)
    return produced, time.perf_counter() - started


def aggregate(base_url: str, streams: int, tokens: int) -> tuple[int, float]:
    """(completion tokens, wall seconds) of `streams` concurrent requests."""
    counts = [0] * streams

    def one(i: int) -> None:
        counts[i] = chat(base_url, i, tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(counts), time.perf_counter() - started


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
        # name -> measure -> [(tokens per wall second, server CPU seconds per 1000 tokens)]
        results: dict[str, dict[str, list[tuple[float, float]]]] = {n: {"single": [], "aggregate": []} for n in servers}
        measures = {
            "single": lambda url: single(url, args.tokens),
            "aggregate": lambda url: aggregate(url, args.streams, args.tokens // 2),
        }
        for round_ in range(args.rounds):
            for measure, run in measures.items():
                order = list(servers) if round_ % 2 == 0 else list(reversed(servers))
                for name in order:  # one pair, next to each other
                    pid = servers[name].process.pid
                    cpu = cpu_seconds(pid)
                    tokens, wall = run(servers[name].base_url)
                    results[name][measure].append((tokens / wall, (cpu_seconds(pid) - cpu) * 1000 / tokens))
        time.sleep(6)  # the traced server's batch processor exports every 5 s
        print(f"rounds {args.rounds}: {args.tokens} tokens (1 stream); {args.streams} x {args.tokens // 2} tokens")
        for measure in measures:
            for index, unit, what in ((0, "tok/s", "throughput"), (1, "CPU s/1k tok", "server CPU")):
                off = [pair[index] for pair in results["off"][measure]]
                on = [pair[index] for pair in results["on"][measure]]
                ratios = sorted(b / a for a, b in zip(off, on))
                quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
                print(
                    f"{measure:9s} {what:10s} off {statistics.median(off):7.2f}  on {statistics.median(on):7.2f} {unit}"
                    f"  on/off median {statistics.median(ratios):.3f} (quartiles {quartiles[0]:.3f}..{quartiles[2]:.3f})"
                )
        print(f"receiver: {receiver.exports} exports, {receiver.bytes} bytes")
    finally:
        for server in servers.values():
            server.stop()
    overhead(receiver.url, args.streams)


def overhead(collector: str, choices: int, requests: int = 400) -> None:
    """CPU seconds tracing adds per request (span writing and OTLP export), in this process."""
    from deltafin.app.generation import GENERATION_ROUTES
    from deltafin.app.tracing import RequestTracer
    from deltafin.config.schema import TracingConfig
    from deltafin.engine.timeline import Mark, now_ns
    from deltafin.protocol.sampling import SamplingParams
    from deltafin.serving.context import RequestStats

    tracer = RequestTracer(TracingConfig(otlp_endpoint=collector), frozenset(GENERATION_ROUTES))
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [(b"traceparent", TRACEPARENT.encode())],
    }

    def one_request() -> None:
        handle = tracer.start(scope, "r")
        assert handle is not None
        timeline, t = handle.timeline, now_ns()
        timeline.params, timeline.choices = SamplingParams(max_tokens=64, temperature=0.0), choices
        timeline.add(Mark("queue", t, t + 1000, {"deltafin.queue.rows": choices}))
        chunks = [Mark("prefill chunk", t + i, t + i + 1, {"deltafin.positions": 64}) for i in range(4)]
        timeline.add(Mark("prefill", t, t + 10, {"gen_ai.usage.input_tokens": 256}, children=chunks))
        for choice in range(choices):
            attributes = {
                "deltafin.choice": choice,
                "gen_ai.usage.output_tokens": 64,
                "gen_ai.response.finish_reasons": ("length",),
            }
            timeline.add(Mark("decode", t + 10, t + 20, attributes))
        stats = RequestStats(prompt_tokens=256, completion_tokens=64 * choices, model="m", ttft_s=0.1, queue_wait_s=0.0)
        stats.finish_reasons = ["length"] * choices
        tracer.finish(handle, stats, 200, total_s=1.0, completed=True)

    for _ in range(20):  # warm: imports, the exporter's session
        one_request()
    tracer.flush()
    began = time.process_time()
    for done in range(1, requests + 1):
        one_request()
        if done % 100 == 0:
            tracer.flush()  # the export of these spans counts too (and the batch queue never fills: no span dropped)
    traced = (time.process_time() - began) / requests
    began = time.process_time()
    time.sleep(0.5)
    idle = (time.process_time() - began) / requests  # what the process burns anyway in that long (its threads)
    tracer.shutdown()
    spans = 3 + 4 + choices
    print(
        f"tracing CPU per request ({spans} spans, exported): {traced * 1e3:.3f} ms (idle process {idle * 1e3:.4f} ms)"
    )


if __name__ == "__main__":
    main()
