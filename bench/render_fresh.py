"""One chat render (templating + tokenizing, on the calling thread) of a one-line chat whose text is new each time,
so nothing of it was seen before: the render cost a request with fresh content pays (bench/render_cold.py renders
one body over and over). Median of 2000.

    .venv/bin/python bench/render_fresh.py
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
    text = "Write a long story about a dragon number {} who learns to bake bread."
    requests = [
        decode_request(
            msgspec.json.encode({"messages": [{"role": "user", "content": text.format(i)}]}), ChatCompletionRequest
        )
        for i in range(2200)
    ]

    def timed(request: ChatCompletionRequest) -> float:
        started = time.perf_counter()
        services.chat.render(request)
        return (time.perf_counter() - started) * 1e6

    for request in requests[:200]:
        timed(request)
    print(f"render of fresh text, median: {statistics.median(timed(r) for r in requests[200:]):.0f} us")


if __name__ == "__main__":
    main()
