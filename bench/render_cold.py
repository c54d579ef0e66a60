"""One chat render (templating + tokenizing, as a small request's render on the event loop) hot, after 16 MB of
memory traffic, and after the thread slept: how much slower a request that arrives alone runs on this machine.

    .venv/bin/python bench/render_cold.py

A gateway request that arrives while the server is idle runs its Python several times slower than the same code
run back to back (bench/gateway.py --stagger-ms shows it as CPU per request: ~4 ms alone against ~1.5 ms in a
burst). This isolates the effect on one piece of the request path, the render, in one process.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from deltafin.testing import compose_config  # noqa: E402


def main() -> None:
    import msgspec

    from deltafin.app.services import Services
    from deltafin.protocol.chat import ChatCompletionRequest
    from deltafin.protocol.decode import decode_request

    services = Services.load(compose_config(["engine=llama_server", "engine.url=http://127.0.0.1:9"]))
    services.ctx.prompt.prepare_loop_thread()
    gc.collect()
    gc.freeze()
    body = {"messages": [{"role": "user", "content": "Write a long story about a dragon who learns to bake bread."}]}
    request = decode_request(msgspec.json.encode(body), ChatCompletionRequest)

    def timed() -> float:
        started = time.perf_counter()
        services.chat.render(request)
        return (time.perf_counter() - started) * 1e6

    for _ in range(50):
        timed()
    hot = statistics.median(timed() for _ in range(500))
    traffic = [bytearray(8 << 20) for _ in range(2)]
    after_traffic = []
    for _ in range(100):
        for block in traffic:
            block[::4096] = b"x" * len(block[::4096])
        after_traffic.append(timed())
    after_sleep = []
    for _ in range(100):
        time.sleep(0.01)
        after_sleep.append(timed())
    print(
        f"render, median: hot {hot:.0f} us; after 16 MB of memory traffic {statistics.median(after_traffic):.0f} us; "
        f"after a 10 ms sleep {statistics.median(after_sleep):.0f} us"
    )


if __name__ == "__main__":
    main()
