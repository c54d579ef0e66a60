"""Load run, by hand: N concurrent clients mixing streamed and non-streamed requests against a real server.

    .venv/bin/python bench/load.py --clients 24 --requests 4 --max-tokens 8

Starts `python -m deltafin` on a free loopback port (extra Hydra overrides after `--`), waits for /health,
then every client sends its requests one after another (alternating stream / non-stream, chat / completions).
Reports successes, 429s, other statuses, p50/p99 latency of successes, and the server's RSS after one warm-up
request and after the load.
With --url it drives a server that is already running instead (RSS needs --pid then).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from deltafin.testing import LiveServer  # noqa: E402


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None


def request_for(client_index: int, request_index: int, max_tokens: int) -> tuple[str, dict]:
    stream = (client_index + request_index) % 2 == 0
    # Each request differs (client, index), so none is a memo replay.
    text = f"Client {client_index} request {request_index}: say something."
    if request_index % 2 == 0:
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "stream": stream}
        return "/v1/chat/completions", body
    return "/v1/completions", {"prompt": text, "max_tokens": max_tokens, "stream": stream}


async def one_client(http: httpx.AsyncClient, url: str, index: int, args: argparse.Namespace, out: list) -> None:
    for r in range(args.requests):
        path, body = request_for(index, r, args.max_tokens)
        started = time.perf_counter()
        try:
            if body["stream"]:
                async with http.stream("POST", url + path, json=body) as response:
                    async for _ in response.aiter_lines():
                        pass
                    status = response.status_code
            else:
                status = (await http.post(url + path, json=body)).status_code
        except httpx.HTTPError as exc:
            status = type(exc).__name__
        out.append((status, time.perf_counter() - started))


async def run(url: str, args: argparse.Namespace) -> list[tuple[object, float]]:
    results: list[tuple[object, float]] = []
    limits = httpx.Limits(max_connections=args.clients + 4)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as http:
        await asyncio.gather(*(one_client(http, url, i, args, results) for i in range(args.clients)))
    return results


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=24)
    parser.add_argument("--requests", type=int, default=4, help="requests per client, sent one after another")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--url", help="drive this running server instead of starting one")
    parser.add_argument("--pid", type=int, help="with --url: the server's pid, for RSS")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for the server this script starts")
    args = parser.parse_args()

    server = None
    if args.url:
        url, pid = args.url.rstrip("/"), args.pid
    else:
        server = LiveServer(args.overrides)  # python -m deltafin on a free loopback port, log in $TMPDIR
        server.wait_ready(timeout=300)
        url, pid = server.base_url, server.process.pid
    try:
        # One request first, so "before" includes what any first generation allocates (weights touched,
        # per-thread tokenizers, torch's workspace): the growth left is what the load itself costs.
        httpx.post(f"{url}/v1/completions", json={"prompt": "Warm up", "max_tokens": 2}, timeout=args.timeout)
        before = rss_mb(pid)
        started = time.perf_counter()
        results = asyncio.run(run(url, args))
        wall = time.perf_counter() - started
        after = rss_mb(pid)
    finally:
        if server is not None:
            server.stop()

    statuses = Counter(status for status, _ in results)
    ok = [seconds for status, seconds in results if status == 200]
    print(f"clients {args.clients} x {args.requests} requests, max_tokens {args.max_tokens}, wall {wall:.1f} s")
    print(
        f"successes {statuses.get(200, 0)}  429s {statuses.get(429, 0)}  other {dict(statuses - Counter({200: statuses.get(200, 0), 429: statuses.get(429, 0)}))}"
    )
    if ok:
        print(f"latency of successes: p50 {statistics.median(ok):.2f} s  p99 {percentile(ok, 0.99):.2f} s")
    if before is not None and after is not None:
        print(f"server RSS: before {before:.0f} MB, after {after:.0f} MB")


if __name__ == "__main__":
    main()
