"""Scale-out on an existing router: two stock vLLM CPU replicas behind vllm-router, a Deltafin gateway in front.

    .venv/bin/python bench/scale_out.py --streams 8 --tokens 64

Boots replica A (core 0) and replica B (core 1) of the converted default model (deltafin/testing/vllm_server.py: eager,
256 MiB KV cache), vllm-router (`--policy round_robin`) over both, and two gateways: one on A alone, one on the
router. Then, side by side in one run:
1. `--streams` concurrent greedy streams of `--tokens` tokens through each gateway (aggregate tok/s; which replica
   served how many, from vLLM's own `vllm:request_success_total`);
2. the same burst through the router, replica B SIGKILLed once tokens flow, a second burst sent just before:
   how many requests ended whole, how many of those had not streamed a token when B died, how many failed.
Prints the boot times and the resident memory of each process. Needs scripts/install-vllm.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deltafin.engine.weights.loader import convert_gguf, default_cache_dir, resolve_model_path  # noqa: E402
from deltafin.testing import LiveServer, compose_config  # noqa: E402
from deltafin.testing.vllm_server import VllmRouter, VllmServer, served, stream_chat  # noqa: E402

NAME = "smollm2"
#: a gateway whose answers are all vLLM's (no memo), as in tests/gateway/test_e2e_vllm.py
GATEWAY = ["engine=vllm", "model.context_length=2048", "server.memo.entries=0", "engine.max_inflight=16"]


def rss_mib(pid: int) -> float:
    """Resident memory of a process and all its descendants."""
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        try:
            status = Path(f"/proc/{current}/status").read_text()
            total += int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS"))) / 1024
            todo += [int(c) for c in Path(f"/proc/{current}/task/{current}/children").read_text().split()]
        except (FileNotFoundError, StopIteration, ProcessLookupError):
            pass
    return total


async def burst(url: str, streams: int, tokens: int, tag: str, flowing: threading.Event | None = None):
    return await asyncio.gather(
        *(stream_chat(url, f"{tag} {i}: tell me a story.", tokens, flowing) for i in range(streams))
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    model = convert_gguf(resolve_model_path(compose_config().model.path), default_cache_dir())
    a = VllmServer(model, name=NAME, cpus="0")
    b = VllmServer(model, name=NAME, cpus="1")
    started = []
    try:
        a.wait_ready()
        b.wait_ready()
        print(f"boot, started together: A {a.boot_s:.0f} s, B {b.boot_s:.0f} s")
        router = VllmRouter([a.url, b.url], args=("--policy", "round_robin")).wait_ready()
        started.append(router)
        alone, routed = (
            LiveServer([*GATEWAY, f"engine.url={a.url}"]),
            LiveServer([*GATEWAY, f"engine.url={router.url}"]),
        )
        started += [alone, routed]
        alone.wait_ready()
        routed.wait_ready()
        print(
            f"resident MiB: replica A {rss_mib(a.process.pid):.0f}, replica B {rss_mib(b.process.pid):.0f}, router {rss_mib(router.process.pid):.0f}, gateway {rss_mib(routed.process.pid):.0f}"
        )
        asyncio.run(burst(alone.base_url, 2, 4, "warm"))
        asyncio.run(burst(routed.base_url, 2, 4, "warm"))
        for label, gateway in (("A alone", alone), ("router, A+B", routed)):
            before = (served(a), served(b))
            t0 = time.monotonic()
            results = asyncio.run(burst(gateway.base_url, args.streams, args.tokens, label))
            seconds = time.monotonic() - t0
            tokens = sum(r[1] for r in results)
            spread = (served(a) - before[0], served(b) - before[1])
            print(
                f"{label:12s}: {args.streams} streams x {args.tokens} tokens in {seconds:5.1f} s = "
                f"{tokens / seconds:5.1f} tok/s; requests served by A, B: {spread[0]:.0f}, {spread[1]:.0f}"
            )

        flowing, killed = threading.Event(), []

        async def kill_run():
            first = [
                asyncio.create_task(stream_chat(routed.base_url, f"Kill run {i}.", args.tokens, flowing))
                for i in range(args.streams)
            ]
            while not flowing.is_set():
                await asyncio.sleep(0.05)
            second = [
                asyncio.create_task(stream_chat(routed.base_url, f"Late {i}.", args.tokens))
                for i in range(args.streams)
            ]
            await asyncio.sleep(0.3)
            b.kill()
            killed.append(time.monotonic())
            return await asyncio.gather(*first, *second)

        results = asyncio.run(kill_run())
        whole = [r for r in results if r[:4] == (200, args.tokens, "length", None)]
        unstarted = [r for r in results if r[4] is None or r[4] > killed[0]]
        print(
            f"B killed with {len(results)} requests in flight ({len(unstarted)} had not streamed a token): "
            f"{len(whole)} whole, {sum(1 for r in unstarted if r in whole)} of the {len(unstarted)} unstarted "
            f"whole, {len(results) - len(whole)} cut in-stream"
        )
    finally:
        for server in reversed(started):
            server.stop()
        a.stop()
        b.stop()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
