"""Serve the app with uvicorn: JSON logs, slow-client limits, and a graceful stop that exits 0."""

from __future__ import annotations

import socket
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

from deltafin.app.connections import guarded_http
from deltafin.config import DeltafinConfig

#: uvicorn's own last resort (cancel what is left) comes this long after Deltafin's grace, which ends streams
#: cleanly first.
_UVICORN_MARGIN_S = 5.0


class GracefulServer(uvicorn.Server):
    """uvicorn's server, telling the app when a stop signal arrives (uvicorn tells it only after every
    connection has closed) and exiting normally afterwards instead of re-raising the signal."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_signal = on_signal

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if sockets and not self.should_exit:
            # uvicorn names the address only for sockets it bound itself; this one was bound before loading
            self._log_started_message(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        # uvicorn re-raises captured signals once it has stopped, which makes the exit status "killed by
        # SIGTERM"; a drained, orderly stop is exit 0.
        self._captured_signals.clear()
        if first:
            self._on_signal()


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound as uvicorn binds one (SO_REUSEADDR; IPv6 for an address with a colon);
    OSError when this machine cannot listen there."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def serve(app: Any, config: DeltafinConfig, listener: socket.socket) -> None:
    """Serve `app` on `listener` (bound by `bind` before anything loaded) until SIGTERM/SIGINT."""
    server = config.server
    uvicorn_config = uvicorn.Config(
        app,
        host=server.host,
        port=server.port,
        log_config=None,  # keep deltafin.logging's handlers: uvicorn's lines come out as JSON too
        log_level=server.log_level,
        access_log=False,  # the request-context layer writes one richer line per request
        http=guarded_http(server.connections),
        # uvicorn annotates these as int but only hands them to loop.call_later / asyncio.wait_for: seconds
        timeout_keep_alive=server.connections.keep_alive_s,  # type: ignore[arg-type]  # seconds as a float (see above)
        timeout_graceful_shutdown=server.shutdown_grace_s + _UVICORN_MARGIN_S,  # type: ignore[arg-type]  # seconds as a float (see above)
    )
    GracefulServer(uvicorn_config, on_signal=app.drain.begin_from_signal).run(sockets=[listener])
