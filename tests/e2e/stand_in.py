"""A stand-in HTTP server that records the JSON bodies a client POSTs and answers each with a scripted reply:
how the tests learn exactly what a real client (openai-agents, Codex CLI) sends."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

#: (the bodies received so far, this one included) -> (HTTP status, JSON reply)
Reply = Callable[[list[dict]], tuple[int, Any]]


@contextmanager
def stand_in(reply: Reply) -> Iterator[tuple[str, list[dict]]]:
    """(base URL ending in /v1, the bodies it will have received)."""
    bodies: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            bodies.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
            status, answer = reply(bodies)
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/v1", bodies
    finally:
        server.shutdown()
        server.server_close()
