"""The HTTP edge by itself: what Litestar's routing costs a generation request, beside a plain ASGI dispatch.

    .venv/bin/python bench/edge.py --requests 2000 --rounds 40

Both sides serve POST /v1/chat/completions with one trivial ASGI handler (it sends a 2-byte answer), so what
differs is only how a request reaches it: `litestar` is Deltafin's Litestar app (every route it serves, its
exception handler, the generation routes as `@asgi` handlers: Litestar's app, middleware stack and router; no
Request object, no dependency injection), `plain` a dict lookup by path in front of the same app (what
deltafin/app/generation.py did before it served through Litestar). Rounds alternate the two sides; the figure
is the median over rounds of each side's time per request, and their difference: the time Litestar adds to
every generation request (TTFT included: it is spent before the request's work starts).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from litestar import Litestar, asgi  # noqa: E402
from litestar.di import Provide  # noqa: E402

from deltafin.app.errors import handle_exception  # noqa: E402
from deltafin.app.generation import GENERATION_ROUTES  # noqa: E402
from deltafin.app.routes import ROUTES  # noqa: E402

BODY = b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}'


async def answer(scope: Any, receive: Any, send: Any) -> None:
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"{}"})


def litestar_side() -> Any:
    generation = asgi(path=list(GENERATION_ROUTES), copy_scope=False, name="generation")(answer)
    return Litestar(
        route_handlers=[*ROUTES, generation],
        dependencies={"services": Provide(lambda: None, sync_to_thread=False)},
        exception_handlers={Exception: handle_exception},
        debug=False,
        logging_config=None,
    )


class Plain:
    """A dict lookup by path in front of Litestar; the path template set as Litestar's router sets it."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] in GENERATION_ROUTES:
            scope["path_template"] = scope["path"]
            await answer(scope, receive, send)
            return
        await self.app(scope, receive, send)


async def per_request(app: Any, requests: int) -> float:
    """Seconds per request over `requests` sequential requests through `app`."""

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": BODY, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        pass

    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())]
    started = time.perf_counter()
    for _ in range(requests):
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/v1/chat/completions",
            "raw_path": b"/v1/chat/completions",
            "query_string": b"",
            "root_path": "",
            "headers": headers,
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 8000),
            "state": {},
        }
        await app(scope, receive, send)
    return (time.perf_counter() - started) / requests


async def main(requests: int, rounds: int) -> None:
    sides = {"plain": Plain(litestar_side()), "litestar": litestar_side()}
    times: dict[str, list[float]] = {name: [] for name in sides}
    for app in sides.values():
        await per_request(app, requests // 10)  # warm
    for round_ in range(rounds):
        for name in ["plain", "litestar"] if round_ % 2 == 0 else ["litestar", "plain"]:
            times[name].append(await per_request(sides[name], requests))
    plain, litestar = (statistics.median(times[name]) * 1e6 for name in ("plain", "litestar"))
    print(
        f"plain dispatch: {plain:.1f} us per request, Litestar @asgi: {litestar:.1f} us per request "
        f"(median of {rounds} rounds of {requests}); Litestar adds {litestar - plain:+.1f} us"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    asyncio.run(main(args.requests, args.rounds))
