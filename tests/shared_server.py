"""One local Deltafin for the whole e2e tier: every module's models, served side by side by one process
(`+models.NAME=[...]`, deltafin.config.models), started once per test run instead of once per override set.

A module declares what it needs at import (collection), before any test runs:

    GLM_PARA = shared_model("glm-para", lambda root: (path, ["model=glm", ..., "compat=para"]))

and its tests take the `local_server` fixture (tests/conftest.py) and send `model=GLM_PARA.name`. The server's
main model is the default SmolLM2 with one row at a time and a short queue (the queue and 429 tests take seconds);
every declared model is an entry beside it, with its own engine, queue, memo and rules. Only what is collected is
served: one module run alone boots a server with that module's models.

What a shared server cannot hold stays a server of its own: process-wide settings (API keys, connection limits,
a cold interpreter), a model that must fail to load (the whole server's /health would say so), a process whose
memory is measured, and gateways whose upstream is started by the module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

#: a prefix cache of 256 MiB per model: the suite sends hundreds of distinct prompts, which a production-sized
#: cache (2 GiB a model) would keep, in every server process on a shared machine
PREFIX_CACHE = "server.prefix_cache.max_bytes=268435456"
#: the main model's overrides: the default model, one row at a time, a queue of one that times out in a second
MAIN = ["engine.max_batch=1", "server.queue.timeout_s=1.0", "server.queue.max_waiting=1", PREFIX_CACHE]
#: added to an entry that does not set them: no aliases of its model file (every entry of a family would claim
#: them), one grammar worker process (two per model, times twenty models, is forty processes), a small prefix cache
ENTRY_DEFAULTS = {
    "model.aliases": "model.aliases=[]",
    "server.grammar.workers": "server.grammar.workers=1",
    "server.prefix_cache.max_bytes": PREFIX_CACHE,
}


@dataclass
class SharedModel:
    """An entry of the shared server. `prepare(root)` writes (or finds in a cache) its checkpoint under `root`
    and returns (its folder, or None for a model file's own path; the overrides that serve it); `folder` is set
    once the server is started."""

    name: str
    prepare: Callable[[Path], tuple[Path | None, list[str]]]
    folder: Path | None = field(default=None)


REGISTRY: dict[str, SharedModel] = {}


def shared_model(name: str, prepare: Callable[[Path], tuple[Path | None, list[str]]]) -> SharedModel:
    """Declare an entry of the shared server (at module import); the name is what requests send as `model`."""
    if name in REGISTRY:
        raise ValueError(f"{name}: declared twice (shared models are named once, wherever they are used)")
    REGISTRY[name] = model = SharedModel(name, prepare)
    return model


def entry_override(name: str, overrides: list[str]) -> str:
    """`+models.NAME=["...", ...]`: the entry as one Hydra override (each element a quoted string)."""
    keys = {override.split("=", 1)[0].lstrip("+~") for override in overrides}
    full = [*overrides, *(default for key, default in ENTRY_DEFAULTS.items() if key not in keys)]
    quoted = ",".join('"' + item.replace("\\", "\\\\").replace('"', '\\"') + '"' for item in full)
    return f"+models.{name}=[{quoted}]"


def shared_overrides(root: Callable[[str], Path]) -> list[str]:
    """The shared server's command line: MAIN, then every declared entry (prepared under `root(name)`)."""
    overrides = list(MAIN)
    for model in REGISTRY.values():
        folder, entry = model.prepare(root(model.name))
        model.folder = folder
        overrides.append(entry_override(model.name, entry))
    return overrides


def multi_model_overrides(entries: list[tuple[str, list[str]]]) -> list[str]:
    """A server's command line for several (name, overrides): the first as its main model (served as that name,
    with the entries' defaults), every other as an entry `+models.NAME=[...]`. (The tiers' shared gateways.)"""
    (main_name, main), *others = entries
    keys = {override.split("=", 1)[0].lstrip("+~") for override in main}
    defaults = {**ENTRY_DEFAULTS, "model.name": f"model.name={main_name}"}
    return [
        *main,
        *(default for key, default in defaults.items() if key not in keys),
        *(entry_override(name, overrides) for name, overrides in others),
    ]
