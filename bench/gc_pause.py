"""How long a full garbage collection stops the event loop once a server has loaded, with and without freezing
what loading made (deltafin/app/factory.py freezes it when loading ends).

    .venv/bin/python bench/gc_pause.py
    .venv/bin/python bench/gc_pause.py engine=local

Builds the services a server builds (gateway mode by default: tokenizer only, no weights), then times
`gc.collect()` (a full collection, as the collector runs one every so many young ones) before and after
`gc.freeze()`.
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


def full_collection_ms(reps: int = 5) -> float:
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def main() -> None:
    from deltafin.app.services import Services

    overrides = sys.argv[1:] or ["engine=llama_server", "engine.url=http://127.0.0.1:9"]
    services = Services.load(compose_config(["server.memo.entries=0", *overrides]))
    services.ctx.prompt.prepare_loop_thread()
    tracked = len(gc.get_objects())
    before = full_collection_ms()
    gc.freeze()
    after = full_collection_ms()
    print(f"{' '.join(overrides)}: {tracked} objects tracked after loading")
    print(f"full collection: {before:.1f} ms, after gc.freeze(): {after:.2f} ms")


if __name__ == "__main__":
    main()
