"""Validate a composed config against the schema; every failure becomes one line naming the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, SCMode
from omegaconf.errors import OmegaConfBaseException

from deltafin.config.schema import KNOWN_FAMILIES, DeltafinConfig

# conf/ sits beside the package in the repository (the product layout), found from here.
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"

_RANGES: dict[str, tuple[float, float]] = {
    "server.port": (0, 65535),
    "server.max_body_bytes": (1, 1 << 40),
    "server.completion_default_max_tokens": (1, 1 << 30),
    "server.max_n": (1, 128),
    "server.max_stop_sequences": (0, 1024),
    "server.max_top_logprobs": (0, 1000),
    "server.queue.max_waiting": (0, 1 << 20),
    "server.queue.timeout_s": (0, 86400),
    "server.queue.large_body_bytes": (1, 1 << 40),
    "server.queue.max_large_prompts": (1, 1 << 20),
    "server.queue.inline_body_bytes": (0, 1 << 40),
    "server.memo.entries": (0, 1 << 20),
    "server.prefix_cache.min_tokens": (1, 1 << 30),
    "server.shutdown_grace_s": (0, 3600),
    "server.templates.render_timeout_s": (0.01, 600),
    "server.templates.max_rendered_chars": (1, 1 << 34),
    "server.connections.max_open": (1, 1 << 20),
    "server.connections.header_timeout_s": (0.1, 3600),
    "server.connections.body_timeout_s": (0.1, 3600),
    "server.connections.keep_alive_s": (0.1, 3600),
    "engine.max_batch": (1, 1024),
    "engine.max_inflight": (1, 1 << 16),
    "engine.connect_timeout_s": (0.001, 3600),
    "engine.read_timeout_s": (0.001, 86400),
    "engine.retry_after_s": (0, 3600),
    "engine.spare_connections": (0, 64),
    # expert pool (deltafin/engine/experts); whether pool_mb holds a step's experts is checked against the model
    "placement.experts.pool_mb": (0, 1 << 30),
    "placement.experts.readers": (1, 64),
}
_CHOICES: dict[str, tuple[str, ...]] = {
    "model.chat_format": ("template", "xtml"),
    "model.content_format": ("string", "openai"),
    "server.log_level": ("debug", "info", "warning", "error"),
    "engine.api": ("auto", "generate", "completions"),
    "placement.experts.policy": ("lru", "lfru"),
}


#: Routes `server.open_routes` may exempt from the API key (`/schema` covers everything under it).
OPENABLE_ROUTES = ("/health", "/metrics", "/schema")


class ConfigError(ValueError):
    """A config that cannot be served; the message is one line that names the offending key."""


def validate_config(cfg: DictConfig | dict[str, Any]) -> DeltafinConfig:
    """Merge `cfg` into the typed schema and check ranges; returns a typed (structured) config."""
    schema = OmegaConf.structured(DeltafinConfig)
    try:
        merged = OmegaConf.merge(schema, cfg)
        missing = sorted(OmegaConf.missing_keys(merged))
        if missing:
            raise ConfigError(f"{missing[0]}: a value is required (set {missing[0]}=...)")
        OmegaConf.resolve(merged)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "config"
        reason = str(exc).splitlines()[0]
        raise ConfigError(f"{key}: {reason}") from None
    for key, (low, high) in _RANGES.items():
        value = OmegaConf.select(merged, key)
        if not low <= value <= high:
            raise ConfigError(f"{key}: {value} is outside [{low}, {high}]")
    if merged.model.family not in KNOWN_FAMILIES:
        known = ", ".join(sorted(KNOWN_FAMILIES))
        raise ConfigError(f"model.family: {merged.model.family!r} is not a known family ({known})")
    _parser_names_select_variant(merged.model)
    for route in merged.server.open_routes:
        if route not in OPENABLE_ROUTES:
            raise ConfigError(f"server.open_routes: {route!r} is not one of {', '.join(OPENABLE_ROUTES)}")
    for key, allowed in _CHOICES.items():
        value = OmegaConf.select(merged, key)
        if value not in allowed:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(allowed)}")
    _check_engine(merged)
    _check_expert_pool(merged)
    return merged  # type: ignore[return-value]


def _parser_names_select_variant(model: Any) -> None:
    """`model.tool_parser` / `model.reasoning_parser` name the family or one of its variants; a variant
    named there becomes `model.variant` (two different ones are a contradiction)."""
    from deltafin.families import get_family

    variants = get_family(model.family).variants
    for key in ("tool_parser", "reasoning_parser"):
        name = model[key]
        if name is None or name == model.family:
            continue
        if name not in variants:
            known = ", ".join((model.family, *variants))
            raise ConfigError(f"model.{key}: {name!r} is not a parser of family {model.family!r} (known: {known})")
        if model.variant is not None and model.variant != name:
            raise ConfigError(f"model.{key}: {name!r} contradicts model.variant={model.variant!r}")
        model.variant = name


def _check_engine(merged: Any) -> None:
    """The engine's builder must import; an upstream needs an http(s) URL."""
    from hydra.utils import get_method

    target = merged.engine._target_
    try:
        builder = get_method(target)
    except Exception:  # hydra wraps import failures in several types
        raise ConfigError(f"engine._target_: {target!r} cannot be imported") from None
    if getattr(builder, "needs_url", False):
        url = merged.engine.url
        if not url or not str(url).startswith(("http://", "https://")):
            raise ConfigError(f"engine.url: an upstream engine needs http(s)://HOST:PORT (got {url!r})")


def _check_expert_pool(merged: Any) -> None:
    """The pool replaces accelerate's placement of the experts: the two do not combine."""
    placement = merged.placement
    if placement.experts.pool_mb and placement.device_map:
        raise ConfigError(
            "placement.experts.pool_mb: the expert pool places the experts itself; it cannot run with "
            f"placement.device_map={placement.device_map!r} (set one of them)"
        )


def plain_config(config: Any) -> DeltafinConfig:
    """The validated config as plain dataclasses, dicts and lists, for code that reads it per request: an
    omegaconf attribute read costs ~18 us (`config.server.queue.timeout_s` ~55 us), a dataclass one ~30 ns.
    A config that is already plain is returned as it is."""
    if not isinstance(config, DictConfig):
        return config
    return OmegaConf.to_container(  # type: ignore[return-value]
        config, resolve=True, throw_on_missing=False, structured_config_mode=SCMode.INSTANTIATE
    )
