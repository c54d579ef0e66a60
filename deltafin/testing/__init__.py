"""Deltafin's public testing API (docs/testing-api.md), shipped in the wheel: what tests and benchmarks need to run
the real server: the config `python -m deltafin` would serve, a free loopback port, and `LiveServer`, the server
as a real process. Its modules add the other servers (llama-server, vLLM), upstream fakes and test GGUF files.

It lives in the package, not under tests/, so bench/ and projects built on Deltafin can use it without the test
suite (it needs the `test` or `bench` extra: httpx).
It sits on the top floor beside the entry point (tests/test_layers.py): it starts the entry point as a process
and composes config through it, and nothing in the server imports it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import ClassVar

import httpx

from deltafin.cli import checked_config
from deltafin.config import DeltafinConfig
from deltafin.families import FAMILIES
from deltafin.testing.zygote import ForkedProcess, Zygote

#: the folder holding the deltafin package (the checkout, or site-packages): where servers are started from
REPO = Path(__file__).resolve().parents[2]


def compose_config(overrides: list[str] | None = None) -> DeltafinConfig:
    """The config `python -m deltafin` would serve for these overrides (every check but the model path's)."""
    return checked_config(overrides or [])


#: tiny model name (the variant's, else the family's) -> (model.family, model.variant) it is written and served
#: as: every registered family and variant with a tiny recipe, so a new family is tested without an edit here
TINY_SPECS = {
    variant or name: (name, variant)
    for name, family in sorted(FAMILIES.items())
    for variant in family.variants or (None,)
    if family.tiny_recipe(variant) is not None
}
TINY_FAMILIES = tuple(TINY_SPECS)
#: tiny model name -> the Hydra overrides that serve it (conf/model/FAMILY.yaml, plus the variant)
TINY_OVERRIDES = {
    name: [f"model={family}", *([f"model.variant={variant}"] if variant else [])]
    for name, (family, variant) in TINY_SPECS.items()
}


def stop_process(process: subprocess.Popen | ForkedProcess, grace_s: float = 15) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `grace_s`; waits for the exit."""
    process.terminate()
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=grace_s)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LiveServer:
    """`python -m deltafin` as a real process on a free loopback port, its output in a log file."""

    #: the overrides of every server started in this process, in order (the test suite reports the count)
    boots: ClassVar[list[tuple[str, ...]]] = []
    #: set by the test suite: servers are forked from a zygote that has done the imports (deltafin.testing.zygote),
    #: started on first use
    fork_from_zygote: ClassVar[bool] = False
    _zygote: ClassVar[Zygote | None] = None
    _zygote_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, overrides: list[str], *, port: int | None = None, cold: bool = False) -> None:
        """`port`: a chosen one, else a free one. `cold`: a fresh interpreter even where a zygote is set (a test
        of everything the process prints, say)."""
        self.overrides = list(overrides)
        self.cold = cold
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"deltafin-test-{self.port}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 (the process's log: closed when it stops)
        self.process: subprocess.Popen | ForkedProcess = self._start()

    def _start(self) -> subprocess.Popen | ForkedProcess:
        LiveServer.boots.append(tuple(self.overrides))
        argv = [f"server.port={self.port}", *self.overrides]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        if LiveServer.fork_from_zygote and not self.cold:
            with LiveServer._zygote_lock:
                if LiveServer._zygote is None:
                    LiveServer._zygote = Zygote(REPO, env)
            return LiveServer._zygote.start(argv, env=env, cwd=REPO, log=self.log_path)
        return subprocess.Popen(
            [sys.executable, "-m", "deltafin", *argv], cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, env=env
        )

    def restart(self) -> None:
        """A new process with the same overrides on the same port, after `stop` (an upstream that comes back
        where a gateway expects it); the log file starts afresh."""
        if self.process.poll() is None:
            raise RuntimeError("restart() follows stop(): this server is still running")
        self._log = open(self.log_path, "w")  # noqa: SIM115 (the process's log: closed when it stops)
        self.process = self._start()

    def wait_ready(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready in {timeout} s:\n{self.log_path.read_text()[-3000:]}")

    def log_lines(self) -> list[str]:
        self._log.flush()
        return self.log_path.read_text().splitlines()

    def request_log(self, request_id: str, timeout: float = 5.0) -> dict:
        """The access-log line of one request (written just after its response, so poll for it)."""
        deadline = time.monotonic() + timeout
        while True:
            for line in self.log_lines():
                if line.startswith("{") and f'"request_id": "{request_id}"' in line and '"event": "request"' in line:
                    return json.loads(line)
            if time.monotonic() > deadline:
                raise AssertionError(f"no log line for request {request_id}")
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop the process (SIGTERM, then SIGKILL after 15 s); again after it stopped, nothing."""
        if self._log.closed:
            return
        try:
            stop_process(self.process)
        finally:
            self._log.close()
