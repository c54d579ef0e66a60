"""The vLLM tier's session fixture (registered by tests/conftest.py's pytest_plugins): every vLLM the collected
modules declared, booted together, and ONE Deltafin gateway in front of them all, a model entry per upstream
(`+models.NAME=[...]`, deltafin.config.models), instead of a gateway per module or per upstream.

A module declares its upstreams at import (collection), before any test runs:

    vllm_upstreams("replicas", Replicas)

where `Replicas(root)` starts its vLLM processes without waiting for them (every declared group boots at once),
`.wait_ready()` waits for them, `.entries()` (once every group is ready; it may start more, a router say) gives
the gateway's models, {served name: overrides}, and `.stop()` ends what it started. Its tests take `vllm_tier`
and send each request's `model`: the first entry of the first group is the gateway's main model, the others are
entries beside it, each with its own engine and upstream, so none depends on which is main. Every model is served
under its entry name only (`model.aliases=[]`: two entries of one model file would claim the same aliases), with
one grammar worker process (tests/shared_server.py's entry defaults). Only groups with a selected test are booted:
a module run alone boots its own vLLMs only.

Each entry has its own engine, so an upstream a test kills fails that entry's requests alone; the gateway's
overall /health is 503 from then on (every upstream must answer), and its per-model map ("models") says which.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import pytest

from deltafin.testing import LiveServer
from tests.shared_server import multi_model_overrides


class Upstreams(Protocol):
    def wait_ready(self) -> None: ...

    def entries(self) -> dict[str, list[str]]: ...

    def stop(self) -> None: ...


@dataclass
class Declared:
    name: str
    start: Callable[[Path], Upstreams]
    module: str  # the declaring test module (`start`'s), booted only when one of its tests is selected


REGISTRY: dict[str, Declared] = {}


def vllm_upstreams(name: str, start: Callable[[Path], Upstreams]) -> None:
    """Declare a group of upstreams (at module import): `start(root)` starts them under the folder `root`."""
    if name in REGISTRY:
        raise ValueError(f"{name}: declared twice")
    REGISTRY[name] = Declared(name, start, start.__module__)


def gateway_overrides(entries: Sequence[tuple[str, list[str]]]) -> list[str]:
    """The gateway's command line: the first (name, overrides) as its main model, every other as an entry."""
    return multi_model_overrides(list(entries))


@dataclass
class VllmTier:
    gateway: LiveServer
    groups: dict[str, Any]  # declared name -> what its `start` returned


@pytest.fixture(scope="session")
def vllm_tier(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmTier]:
    """Every declared group with a selected test, started at once, then the one gateway over all their models."""
    selected = {item.module.__name__ for item in request.session.items if getattr(item, "module", None)}
    wanted = [each for each in REGISTRY.values() if each.module in selected]
    groups: dict[str, Upstreams] = {}
    try:
        for each in wanted:  # started one after another, booting together
            groups[each.name] = each.start(tmp_path_factory.mktemp(each.name))
        for group in groups.values():
            group.wait_ready()
        entries = [entry for group in groups.values() for entry in group.entries().items()]
        if not entries:
            raise RuntimeError("no vLLM upstreams declared (tests.gateway.vllm_tier.vllm_upstreams)")
        gateway = LiveServer(gateway_overrides(entries))
        try:
            gateway.wait_ready()
            yield VllmTier(gateway, dict(groups))
        finally:
            gateway.stop()
    finally:
        for group in reversed(groups.values()):
            group.stop()
