"""Shared fixtures: the composed default config, the real default model loaded once, a live server."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from deltafin.cli import checked_config  # noqa: E402
from deltafin.config import DeltafinConfig  # noqa: E402
from deltafin.families import FAMILIES  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def compose_config(overrides: list[str] | None = None) -> DeltafinConfig:
    """The config `python -m deltafin` would serve for these overrides (every check but the model path's)."""
    return checked_config(overrides or [])


@pytest.fixture(scope="session")
def config() -> DeltafinConfig:
    return compose_config()


@pytest.fixture(scope="session")
def loaded_model(config: DeltafinConfig):
    """The real embedded model, loaded once for the session (weights shared by every engine below)."""
    from deltafin.engine.loader import load_model

    return load_model(config.model, config.placement)


@pytest.fixture(scope="session")
def float_model():
    """The default GGUF dequantized to float32 (`model.gguf_weights=dequantize`, the path before native GGUF
    weights): the torch decode steps and `placement.quantize` run on float weights."""
    from deltafin.engine.loader import load_model

    config = compose_config(["model.gguf_weights=dequantize"])
    return load_model(config.model, config.placement)


def make_engine(loaded_model, *, max_waiting: int = 4, timeout_s: float = 5.0, memo_entries: int = 32):
    from deltafin.engine import EngineFront
    from deltafin.engine.local import LocalEngine

    return EngineFront(LocalEngine(loaded_model), max_waiting=max_waiting, timeout_s=timeout_s, memo_entries=memo_entries)


@pytest.fixture(scope="module")
def engine(loaded_model):
    """A fresh engine per module: its slot belongs to one event loop, and modules use different loops."""
    return make_engine(loaded_model)


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def services(config: DeltafinConfig, loaded_model):
    from deltafin.app.services import Services

    return Services.from_engine(config, make_engine(loaded_model))


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


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """A tiny random-weight model of every family, written once per session."""
    from deltafin.tiny import write_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    return {name: write_tiny_model(family, root / name, variant=variant) for name, (family, variant) in TINY_SPECS.items()}


def tiny_config(family: str, path: Path, extra: list[str] | None = None) -> DeltafinConfig:
    return compose_config([*TINY_OVERRIDES[family], f"model.path={path}", *(extra or [])])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LiveServer:
    """`python -m deltafin` as a real process on a free loopback port."""

    def __init__(self, overrides: list[str]) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"deltafin-test-{self.port}.log"
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "deltafin", f"server.port={self.port}", *overrides],
            cwd=REPO,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"},
        )

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
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self._log.close()


@pytest.fixture(scope="session")
def live_server() -> Iterator[LiveServer]:
    # One row at a time and a short queue, so the queue and 429 tests take seconds; batching over HTTP is
    # tested on a server of its own (tests/e2e/test_batching.py).
    server = LiveServer(["engine.max_batch=1", "server.queue.timeout_s=1.0", "server.queue.max_waiting=1"])
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
