"""`python -m deltafin [--cfg job] [GROUP=OPTION ...] [KEY=VALUE ...]`: compose the config, check everything that
can be checked without loading a model, then serve; any config error is one line on stderr and exit 2.

Hydra's Compose API does the composition (conf/ groups, the override grammar, interpolations); Hydra's own
command-line runner is not used, so that its errors, `--cfg job` included, go through the same checks.
"""

from __future__ import annotations

import errno
import os
import socket
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from omegaconf import OmegaConf

from deltafin.config import ConfigError, DeltafinConfig, compose_config, conf_dir
from deltafin.config.models import check_served_names, entry_overrides
from deltafin.config.schema import Device

USAGE = """\
usage: python -m deltafin [--cfg job] [GROUP=OPTION ...] [KEY=VALUE ...]

  --cfg job      print the composed, checked config and exit
  -h, --help     print this and exit
  GROUP=OPTION   choose a file of conf/GROUP/ (model=glm)
  KEY=VALUE      set one key (server.port=9000); +KEY=VALUE adds a key to a mapping, ~KEY removes one
Every key, its default and its range: docs/config.md. Config groups and their options:
"""


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        show_config, overrides = _parse(args)
        if show_config is None:
            print(USAGE + _groups())
            return
        configs = checked_configs(overrides, check_paths=not show_config)
        config = configs[0]
        if show_config:
            print(OmegaConf.to_yaml(config), end="")
            return
        for entry, served in zip([None, *config.models], configs):
            with _naming_entry(entry):
                _check_expert_pool(served)
        _check_response_store(config)
        _check_tracing(config)
        listener = _listen(config)
    except ConfigError as exc:
        print(f"deltafin: config error: {exc}", file=sys.stderr)
        sys.exit(2)

    from deltafin.app import build_app
    from deltafin.app.server import serve
    from deltafin.logging import configure_logging

    _without_triton(config)
    configure_logging(config.server.log_level)
    serve(build_app(config, models=configs[1:]), config, listener)


def checked_configs(overrides: Sequence[str] = (), *, check_paths: bool = False) -> list[DeltafinConfig]:
    """The main config for `overrides`, then each of its `models` entries' (deltafin.config.models), each
    checked as `checked_config` checks one; an entry's error names it (`models.NAME: KEY: reason`)."""
    config = checked_config(overrides, check_path=check_paths)
    configs = [config]
    for name, entry in config.models.items():
        with _naming_entry(name):
            configs.append(checked_config(entry_overrides(name, list(entry)), check_path=check_paths))
    check_served_names(
        [(entry or "", [each.model.name, *each.model.aliases]) for entry, each in zip([None, *config.models], configs)]
    )
    return configs


@contextmanager
def _naming_entry(entry: str | None) -> Iterator[None]:
    """A ConfigError raised for the `models` entry `entry` (None: the main config) names the entry first."""
    try:
        yield
    except ConfigError as exc:
        if entry is None or str(exc).startswith(f"models.{entry}:"):
            raise
        raise ConfigError(f"models.{entry}: {exc}") from None


def checked_config(overrides: Sequence[str] = (), *, check_path: bool = False) -> DeltafinConfig:
    """The config for `overrides`, checked as far as it can be without the model or the network: the schema
    and its field checks, `model.path`'s existence (`check_path`: not for `--cfg job`, which may describe
    another machine), the family and its variant, the rules, the engine's builder. The path comes first, before
    the checks that import torch: a typo in it is answered in a fraction of a second."""
    config = compose_config(overrides)
    if check_path:
        _check_model_path(config)
        _check_cache_folder(config)
        _check_speculation(config)

    from deltafin.families import check_model  # after composition: these import the prompt formats (~1 s)
    from deltafin.rules import build_pipeline

    check_model(config.model)
    build_pipeline(config.compat.rules, config.model.family)
    _check_engine(config)
    return config


def _without_triton(config: DeltafinConfig) -> None:
    """triton comes with xgrammar (its GPU kernels) and torch._dynamo imports it whenever it is installed (the
    model code imports torch._dynamo); on the CPU nothing runs it, and its bindings print "nanobind: leaked ..."
    lines at exit. A None in sys.modules makes `import triton` fail as if it were not installed."""
    if config.placement.device == Device.cpu:
        sys.modules.setdefault("triton", None)  # type: ignore[arg-type]  # a None entry blocks the import (sys.modules' stubs allow modules only)


def _parse(args: list[str]) -> tuple[bool | None, list[str]]:
    """(True for --cfg job, False to serve, None for --help; the overrides)."""
    show_config: bool | None = False
    overrides: list[str] = []
    while args:
        arg = args.pop(0)
        if arg in ("-h", "--help"):
            return None, []
        if arg in ("-c", "--cfg") or arg.startswith("--cfg="):
            what = arg.partition("=")[2] or (args.pop(0) if args else "")
            if what != "job":
                raise ConfigError(f"--cfg: {what!r} is not supported (--cfg job prints the config)")
            show_config = True
        elif arg.startswith("-"):
            raise ConfigError(f"{arg}: not an option of python -m deltafin (--cfg job, --help; the rest are overrides)")
        else:
            overrides.append(arg)
    return show_config, overrides


def _groups() -> str:
    root = conf_dir()
    lines = []
    for group in sorted(p for p in root.iterdir() if p.is_dir()):
        options = ", ".join(sorted(f.stem for f in group.glob("*.yaml")))
        lines.append(f"  {group.name}: {options}")
    return "\n".join(lines)


def _check_engine(config: DeltafinConfig) -> None:
    """The engine's builder must import; an upstream's needs a URL."""
    from hydra.utils import get_method

    target = config.engine._target_
    try:
        builder = get_method(target)
    except Exception:  # hydra wraps import failures in several types
        raise ConfigError(f"engine._target_: {target!r} cannot be imported") from None
    if getattr(builder, "needs_url", False) and not config.engine.url:
        raise ConfigError("engine.url: a value is required by an upstream engine (engine.url=http://HOST:PORT)")


def _check_model_path(config: DeltafinConfig) -> None:
    """`model.path` must exist (a `pkg:` path: its package must be installed; a Hub id: cached, or on the Hub when
    online, deltafin.engine.weights.hub); loading comes later."""
    from deltafin.engine.weights.paths import ModelLoadError, check_model_path

    try:
        # an upstream engine (it has a URL; the local one never does) reads the tokenizer and config only
        check_model_path(config.model, weights=config.engine.url is None)
    except ModelLoadError as exc:
        raise ConfigError(str(exc)) from None


def _check_cache_folder(config: DeltafinConfig) -> None:
    """The prefix cache's disk folder must exist or be creatable, and be writable by this process."""
    folder = config.server.prefix_cache.disk_dir
    if folder is None or not config.server.prefix_cache.enabled:
        return
    try:
        os.makedirs(folder, exist_ok=True)
        if not os.access(folder, os.W_OK | os.X_OK):
            raise PermissionError("not writable")
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ConfigError(f"server.prefix_cache.disk_dir: {folder!r} cannot be used as a folder ({reason})") from None


def _check_speculation(config: DeltafinConfig) -> None:
    """A draft model must exist; MTP needs a checkpoint whose files hold its MTP layers (read from the files,
    before anything loads)."""
    from deltafin.engine.weights.mtp_layers import mtp_layer_index
    from deltafin.engine.weights.paths import ModelLoadError, resolve_model_path

    speculative = config.engine.speculative
    if speculative.method == "draft":
        try:
            resolve_model_path(str(speculative.draft_path))
        except ModelLoadError as exc:
            raise ConfigError(str(exc).replace("model.path:", "engine.speculative.draft_path:", 1)) from None
    elif speculative.method == "mtp":
        index, why = mtp_layer_index(resolve_model_path(config.model.path))
        if index is None:
            raise ConfigError(f"engine.speculative.method: mtp needs the checkpoint's MTP layers; {why}")


def _check_expert_pool(config: DeltafinConfig) -> None:
    """The pool replaces accelerate's placement of the experts (the two do not combine), and it must hold one
    step's experts for a full batch: checked against the model's config.json before any weight loads. A
    published quantized checkpoint's format is checked here too (one the engine does not serve, or a placement
    that cannot serve it, is a config error naming the field)."""
    from deltafin.engine.weights.loader import ModelLoadError, check_expert_pool, check_published_format

    try:
        check_published_format(config.model, config.placement)
    except ModelLoadError as exc:
        raise ConfigError(str(exc)) from None

    placement = config.placement
    if placement.experts.pool_mb and placement.device_map:
        raise ConfigError(
            "placement.experts.pool_mb: the expert pool places the experts itself; it cannot run with "
            f"placement.device_map={placement.device_map!r} (set one of them)"
        )
    try:
        check_expert_pool(config.model, placement, max_batch=config.engine.max_batch)
    except ModelLoadError as exc:
        raise ConfigError(str(exc)) from None


def _check_response_store(config: DeltafinConfig) -> None:
    """A response store that cannot be opened (a foreign or corrupt sqlite file, a missing folder) stops start-up
    here, never loses stored responses silently later."""
    from deltafin.serving.responses.store import open_store

    open_store(config.server.responses).close()


def _check_tracing(config: DeltafinConfig) -> None:
    """Tracing needs OpenTelemetry's SDK and OTLP exporter, an optional extra: without them, a config error."""
    if config.server.tracing.otlp_endpoint is None:
        return
    import importlib.util

    for module in ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http.trace_exporter"):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            raise ConfigError(
                "server.tracing.otlp_endpoint: tracing needs OpenTelemetry's SDK and OTLP/HTTP exporter "
                f"({module} is not installed: pip install 'deltafin[tracing]')"
            )


def _listen(config: DeltafinConfig) -> socket.socket:
    """The server's socket, bound now: an address this machine cannot listen on is a config error before
    anything loads, and `server.port=0` takes a free port."""
    from deltafin.app.server import bind

    host, port = config.server.host, config.server.port
    try:
        return bind(host, port)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        key = "server.port" if exc.errno in (errno.EADDRINUSE, errno.EACCES) else "server.host"
        raise ConfigError(f"{key}: cannot listen on {host}:{port}: {reason}") from None
