"""Shared fixtures: the composed default config, the real default model loaded once, a live server."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from deltafin.config import DeltafinConfig  # noqa: E402

# Test modules import these from here too (tests.conftest), as they did before they moved to the package.
from deltafin.testing import (  # noqa: E402, F401
    TINY_FAMILIES,
    TINY_OVERRIDES,
    TINY_SPECS,
    LiveServer,
    compose_config,
    free_port,
)

REPO = Path(__file__).resolve().parents[1]
# Session fixtures shared by several modules of a tier live beside that tier, registered here.
pytest_plugins = ["tests.gateway.llama_tier", "tests.gateway.vllm_tier"]
# Servers start as forks of one process that has done their imports (seconds each saved; deltafin.testing.zygote).
# DELTAFIN_TEST_COLD_BOOT=1 starts each as a fresh `python -m deltafin` instead.
LiveServer.fork_from_zygote = os.environ.get("DELTAFIN_TEST_COLD_BOOT") != "1"


@pytest.fixture(autouse=True)
def torch_threads_restored() -> Iterator[None]:
    """Each test leaves torch's thread count as it found it: building a local engine in process (an app under
    TestClient) loads with one thread, process-wide, and a later test's float sums would then run in another
    order (the native step's agreement with the module tree is measured at the machine's thread count)."""
    import torch

    before = torch.get_num_threads()
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def config() -> DeltafinConfig:
    return compose_config()


@pytest.fixture(scope="session")
def loaded_model(config: DeltafinConfig):
    """The real embedded model, loaded once for the session (weights shared by every engine below)."""
    from deltafin.engine.weights.loader import load_model

    return load_model(config.model, config.placement)


@pytest.fixture(scope="session")
def float_model():
    """The default GGUF dequantized to float32 (`model.gguf_weights=dequantize`, the path before native GGUF
    weights): the torch decode steps and `placement.quantize` run on float weights."""
    from deltafin.engine.weights.loader import load_model

    config = compose_config(["model.gguf_weights=dequantize"])
    return load_model(config.model, config.placement)


def make_engine(loaded_model, *, max_waiting: int = 4, timeout_s: float = 5.0, memo_entries: int = 32):
    from deltafin.engine import EngineFront
    from deltafin.engine.local.engine import LocalEngine

    return EngineFront(
        LocalEngine(loaded_model), max_waiting=max_waiting, timeout_s=timeout_s, memo_entries=memo_entries
    )


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


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """A tiny random-weight model of every family, written once per session."""
    from deltafin.tiny import write_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    return {
        name: write_tiny_model(family, root / name, variant=variant) for name, (family, variant) in TINY_SPECS.items()
    }


def tiny_config(family: str, path: Path, extra: list[str] | None = None) -> DeltafinConfig:
    return compose_config([*TINY_OVERRIDES[family], f"model.path={path}", *(extra or [])])


@pytest.fixture(scope="session")
def local_server(tmp_path_factory) -> Iterator[LiveServer]:
    """The e2e tier's one local server (tests/shared_server.py): the default model (one row at a time, a short
    queue: the queue and 429 tests take seconds) and, beside it, every model the collected modules declared."""
    from tests.shared_server import shared_overrides

    server = LiveServer(shared_overrides(tmp_path_factory.mktemp))
    try:
        server.wait_ready(timeout=600)  # every entry loads, one after another
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def live_server(local_server) -> LiveServer:
    """The shared server, for tests that use its main model (the default SmolLM2)."""
    return local_server


#: the keyed server's API keys: tests/e2e/test_auth.py checks them; the gateway of tests/gateway/test_e2e_deltafin.py
#: sends the first as its `engine.api_key`
API_KEYS = ("k1", "k2")


@pytest.fixture(scope="session")
def keyed_server() -> Iterator[LiveServer]:
    """The default model behind API keys (a process-wide setting: a server of its own). It is the upstream of the
    Deltafin gateway tests, whose last test stops it and restarts it where the gateway expects it."""
    server = LiveServer([f"server.api_keys=[{','.join(API_KEYS)}]"])
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
