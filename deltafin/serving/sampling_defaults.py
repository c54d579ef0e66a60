"""A model's default sampling (`model.sampling`, `model.sampling_source`): where it comes from, and how a request
that leaves a field out gets it.

The values come from the checkpoint's `generation_config.json` (`sampling_source: checkpoint`, the default: the
keys vLLM reads there, `max_new_tokens` as `max_tokens`), with `model.sampling` for the fields it does not state;
from `model.sampling` alone (`config`); or from nowhere (`none`: OpenAI's defaults, temperature 1 and no top-p,
top-k, min-p or penalties). They fill the request's own fields before the compat rules run, so the request's
values win over them (only a field the request leaves out is filled) and a rule that pins or bounds a field
(`sampling_pins`, `max_tokens_cap`, `chat_default_max_tokens`) wins over them too. Every API gets them: chat,
completions, and the APIs served as a chat request (Responses).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import msgspec
import structlog

from deltafin.config import ModelConfig
from deltafin.engine.weights.paths import ModelLoadError, local_model_path
from deltafin.protocol.sampling import DEFAULTABLE, NO_DEFAULTS, SamplingDefaults

log = structlog.get_logger("deltafin.serving")

#: generation_config.json key -> the request field it is a default of (the keys vLLM applies; `do_sample`, which
#: vLLM ignores too, is not one)
CHECKPOINT_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}

#: the values each field accepts (the request's own bounds, protocol/common.py); a checkpoint's value outside them
#: is left out with a warning, never served
_BOUNDS: dict[str, tuple[float, float, bool]] = {
    "temperature": (0.0, 2.0, False),
    "top_p": (0.0, 1.0, False),  # (0, 1]: checked below
    "top_k": (-1, 1 << 30, True),
    "min_p": (0.0, 1.0, False),
    "repetition_penalty": (0.01, 10.0, False),
    "presence_penalty": (-2.0, 2.0, False),
    "frequency_penalty": (-2.0, 2.0, False),
    "max_tokens": (1, 1 << 30, True),
}


def sampling_defaults_for(model: ModelConfig, checkpoint: Path | None) -> SamplingDefaults:
    """The defaults `model` is served with; `checkpoint`: the folder holding its generation_config.json (None:
    a GGUF file or no folder, which carries none)."""
    source = str(model.sampling_source)
    if source == "none":
        return NO_DEFAULTS
    chosen: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name in DEFAULTABLE:
        value = getattr(model.sampling, name)
        if value is not None:
            chosen[name], sources[name] = value, "model.sampling"
    if source == "checkpoint" and checkpoint is not None:
        for name, value in checkpoint_sampling(checkpoint).items():
            chosen[name], sources[name] = value, "generation_config.json"
    if not chosen:
        return NO_DEFAULTS
    defaults = SamplingDefaults(**chosen, sources=tuple(sorted(sources.items())))
    log.info("sampling_defaults", model=model.name, **defaults.values(), sources=dict(defaults.sources))
    return defaults


def checkpoint_folder(model: ModelConfig) -> Path | None:
    """The checkpoint folder whose generation_config.json counts (None for a GGUF file, which has none)."""
    try:
        path = local_model_path(model)
    except ModelLoadError:
        return None
    return path if path is not None and path.is_dir() else None


def checkpoint_sampling(folder: Path) -> dict[str, float | int]:
    """The sampling values `folder/generation_config.json` states (an absent or unreadable file: none; a value of
    the wrong type or out of range is left out, with a warning)."""
    path = folder / "generation_config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("generation_config_unreadable", path=str(path), error=str(exc))
        return {}
    if not isinstance(raw, dict):
        log.warning("generation_config_unreadable", path=str(path), error="not a JSON object")
        return {}
    values: dict[str, float | int] = {}
    for key, name in CHECKPOINT_KEYS.items():
        if key not in raw or raw[key] is None:
            continue
        value = _acceptable(name, raw[key])
        if value is None:
            log.warning("generation_config_value_ignored", path=str(path), key=key, value=repr(raw[key])[:80])
            continue
        values[name] = value
    return values


def _acceptable(name: str, value: Any) -> float | int | None:
    low, high, integral = _BOUNDS[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    if integral and value != int(value):
        return None
    if not low <= value <= high or (name == "top_p" and value == 0):
        return None
    return int(value) if integral else float(value)


def with_sampling_defaults(request: Any, defaults: SamplingDefaults) -> Any:
    """`request` with each sampling field it leaves out (None) set to the model's default; the request itself
    when nothing changes. The default max tokens is not a request field: the request's plan takes it (its token
    budget's default, before the rules' own)."""
    if defaults is NO_DEFAULTS:
        return request
    changes: dict[str, Any] = {}
    for name in DEFAULTABLE[:-1]:
        value = getattr(defaults, name)
        if value is not None and getattr(request, name, _ABSENT) is None:
            changes[name] = value
    return msgspec.structs.replace(request, **changes) if changes else request


_ABSENT = object()
