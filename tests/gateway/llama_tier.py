"""The llama-server tier's session fixtures (registered by tests/conftest.py's pytest_plugins): the tier's
llama-server processes, each started once, and ONE Deltafin gateway (`engine=llama_server`) in front of them that
serves every model the collected modules declared, side by side (`+models.NAME=[...]`, deltafin.config.models).

A module declares what it needs at import (collection), after its `unavailable(...)` check, so a module skipped
for want of the binary declares nothing:

    QWEN3 = gateway_model("llama-smollm2-qwen3", SMOLLM2, ["engine.max_inflight=1", "model.family=qwen3"])

and its tests take the `llama_tier` fixture: `llama_tier.gateway` is the gateway (a LiveServer; requests send
`model=QWEN3.name`), `llama_tier.url(SMOLLM2)` a llama-server itself. Nothing starts before a test asks: a
module whose tests only talk to llama-server starts no gateway, and the gateway starts (once) the llama-servers
its entries use. Only what is collected is served: one module run alone boots a gateway with that module's models.

The first declared model is the gateway's main one (a request without `model` goes to it): tests send `model`
always, so none depends on which that is. Every model is served under its entry name only (`model.aliases=[]`:
two entries of one model file would claim the same aliases), with one grammar worker process.

Importing this module starts nothing and imports nothing heavy: every pytest run imports it, also where
llama-server is not built.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest

from deltafin.testing import LiveServer, stop_process

#: where the tier's llama-server logs go (one file per server, named by its key)
LOG_DIR = Path(os.environ.get("TMPDIR", "/tmp"))


@dataclass(eq=False)
class Upstream:
    """A llama-server of the tier, started at most once per session. `prepare(root)` writes (or finds in a cache)
    under `root` what it serves and returns (the model folder a Deltafin serves, None for the default model's
    own path; the GGUF llama-server loads)."""

    key: str
    prepare: Callable[[Path], tuple[Path | None, Path]]
    parallel: int
    context: int


@dataclass(eq=False)
class GatewayModel:
    """An entry of the tier's gateway: the model `upstream` serves, under `name`, with `overrides` (a list, or a
    function of the upstream's model folder); `engine=llama_server engine.url=...` are added."""

    name: str
    upstream: Upstream
    overrides: Sequence[str] | Callable[[Path | None], Sequence[str]]

    def entry(self, folder: Path | None, url: str) -> list[str]:
        own = self.overrides(folder) if callable(self.overrides) else self.overrides
        return ["engine=llama_server", f"engine.url={url}", *own]


def _default_gguf(root: Path) -> tuple[None, Path]:
    from deltafin.engine.weights.loader import resolve_model_path
    from deltafin.testing import compose_config

    return None, resolve_model_path(compose_config().model.path)


#: the default SmolLM2 GGUF, two slots of 2048 tokens (-c 4096 is shared by the -np slots): the gateway's SmolLM2
#: entries and the GBNF tests' direct requests use it
SMOLLM2 = Upstream("smollm2", _default_gguf, parallel=2, context=4096)

#: the gateway's models, in declaration order (the first is its main model)
GATEWAY_MODELS: dict[str, GatewayModel] = {}


def gateway_model(
    name: str, upstream: Upstream, overrides: Sequence[str] | Callable[[Path | None], Sequence[str]] = ()
) -> GatewayModel:
    """Declare an entry of the tier's gateway (at module import); `name` is what requests send as `model`."""
    if name in GATEWAY_MODELS:
        raise ValueError(f"{name}: declared twice (gateway models are named once, wherever they are used)")
    GATEWAY_MODELS[name] = model = GatewayModel(name, upstream, overrides)
    return model


def gateway_overrides(entries: Sequence[tuple[str, list[str]]]) -> list[str]:
    """The gateway's command line: the first (name, overrides) as its main model, every other as an entry."""
    from tests.shared_server import multi_model_overrides

    return multi_model_overrides(list(entries))


@dataclass
class _Started:
    process: subprocess.Popen
    url: str
    folder: Path | None
    log: IO[str]


class LlamaTier:
    """The session's llama-servers and gateway, each started on first use, all stopped by `close`."""

    def __init__(self, root: Callable[[str], Path]) -> None:
        self._root = root
        self._started: dict[str, _Started] = {}
        self._gateway: LiveServer | None = None
        self._gateway_error: BaseException | None = None

    def _start(self, upstream: Upstream) -> _Started:
        if upstream.key not in self._started:
            folder, gguf = upstream.prepare(self._root(upstream.key))
            log = open(LOG_DIR / f"llama-server-{upstream.key}-{os.getpid()}.log", "w")  # noqa: SIM115 (the process's log: closed when it stops)
            try:
                from deltafin.testing.llama_server import start_llama_server

                process, url = start_llama_server(gguf, parallel=upstream.parallel, context=upstream.context, log=log)
            except BaseException:
                log.close()
                raise
            self._started[upstream.key] = _Started(process, url, folder, log)
        return self._started[upstream.key]

    def url(self, upstream: Upstream) -> str:
        """llama-server's base URL (started now if it is not yet)."""
        return self._start(upstream).url

    def folder(self, upstream: Upstream) -> Path | None:
        """The model folder the upstream serves (None: the default model's own path)."""
        return self._start(upstream).folder

    @property
    def gateway(self) -> LiveServer:
        """The one gateway, serving every declared model (started now, with their llama-servers, if it is not
        yet; a gateway that failed to start fails every test that asks, without another boot)."""
        if self._gateway_error is not None:
            raise RuntimeError("the llama-server tier's gateway failed to start") from self._gateway_error
        if self._gateway is None:
            try:
                if not GATEWAY_MODELS:
                    raise RuntimeError("no gateway model declared (tests.gateway.llama_tier.gateway_model)")
                entries = []
                for model in GATEWAY_MODELS.values():
                    started = self._start(model.upstream)
                    entries.append((model.name, model.entry(started.folder, started.url)))
                server = LiveServer(gateway_overrides(entries))
                try:
                    server.wait_ready()
                except BaseException:
                    server.stop()
                    raise
            except Exception as error:
                self._gateway_error = error
                raise
            self._gateway = server
        return self._gateway

    def close(self) -> None:
        try:
            if self._gateway is not None:
                self._gateway.stop()
        finally:
            for started in reversed(self._started.values()):
                stop_process(started.process)
                started.log.close()


@pytest.fixture(scope="session")
def llama_tier(tmp_path_factory) -> Iterator[LlamaTier]:
    """The tier's llama-servers and its one gateway, each started when a test first asks for it."""
    tier = LlamaTier(tmp_path_factory.mktemp)
    try:
        yield tier
    finally:
        tier.close()
