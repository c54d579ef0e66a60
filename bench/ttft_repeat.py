"""The TTFT of a repeated ~1.1k-token prompt on the default config, request by request: the client's time to
the first content chunk beside the server's own prefill time (the repeated prompt's TTFT, in more detail than
bench/throughput.py's median).

    flock /tmp/deltafin-bench.lock .venv/bin/python bench/ttft_repeat.py [--reps 12] [override ...]

Starts the default server (`python -m deltafin`, memo off, plus any Hydra overrides given, e.g.
`placement.num_threads=1`), sends bench/throughput.py's LONG_PROMPT once (it goes to the prefix cache), then
`--reps` streamed requests of it (`max_tokens` 4, greedy). Prints the medians and every figure sorted: on a
busy machine the distribution says more than a median (the first-round regression was bimodal, ~40 ms or ~410
ms of server prefill for the one position that runs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.throughput import LONG_PROMPT  # noqa: E402
from deltafin.testing import LiveServer  # noqa: E402


def first_content_ms(base_url: str, body: dict, request_id: str) -> float:
    started = time.perf_counter()
    first = None
    with httpx.stream(
        "POST",
        f"{base_url}/v1/chat/completions",
        json={**body, "stream": True},
        timeout=600,
        headers={"x-request-id": request_id},
    ) as response:
        for line in response.iter_lines():
            if first is None and '"content":"' in line and '"content":""' not in line:
                first = time.perf_counter() - started
    assert first is not None, "no content chunk came back"
    return first * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=12)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for the server")
    args = parser.parse_args()
    server = LiveServer(["server.memo.entries=0", "server.queue.timeout_s=600", *args.overrides])
    try:
        server.wait_ready()
        body = {"messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": 4, "temperature": 0}
        warm = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=600)
        warm.raise_for_status()
        client, prefill, cached = [], [], []
        for _ in range(args.reps):
            request_id = uuid.uuid4().hex
            client.append(round(first_content_ms(server.base_url, body, request_id), 1))
            entry = server.request_log(request_id)
            prefill.append(round(entry["prefill_ms"], 1))
            cached.append(entry.get("cached_tokens"))
    finally:
        server.stop()
    print(
        f"overrides {args.overrides}, prompt {warm.json()['usage']['prompt_tokens']} tokens, cached {set(cached)}, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(f"client TTFT median {statistics.median(client):.1f} ms: {sorted(client)}")
    print(f"server prefill median {statistics.median(prefill):.1f} ms: {sorted(prefill)}")


if __name__ == "__main__":
    main()
