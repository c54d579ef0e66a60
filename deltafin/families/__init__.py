"""Model families by name (`model.family`): each module in this package registers its families, so a new
family is one module here plus one conf/model/*.yaml. Nothing outside a family's module branches on it."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Sequence
from typing import Any, TypeVar

from deltafin.config import ConfigError
from deltafin.families.base import BoundFamily, ModelFamily, TinyRecipe
from deltafin.markup.parsing import IdFactory, OutputParser

__all__ = [
    "FAMILIES",
    "BoundFamily",
    "KNOWN_FAMILIES",
    "ModelFamily",
    "TinyRecipe",
    "bind_family",
    "build_output_parser",
    "check_family",
    "check_model",
    "get_family",
    "register",
]

FAMILIES: dict[str, ModelFamily] = {}

F = TypeVar("F", bound=type[ModelFamily])


def register(cls: F) -> F:
    """Class decorator: one instance of the family, known by its `name`."""
    if cls.name in FAMILIES:
        raise ValueError(f"model family {cls.name!r} is registered twice")
    FAMILIES[cls.name] = cls()
    return cls


def get_family(name: str) -> ModelFamily:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"model.family: {name!r} is not a known family ({', '.join(sorted(FAMILIES))})") from None


def bind_family(family: str, variant: str | None = None) -> BoundFamily:
    """`model.family` bound to `model.variant` (None: the family's default variant), once per served model."""
    spec = get_family(family)
    return BoundFamily(spec, spec.variant(variant))


def check_family(family: str, variant: str | None) -> None:
    """Start-up check of model.family / model.variant: a one-line ConfigError naming the key."""
    try:
        get_family(family).variant(variant)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def check_model(model: Any) -> None:
    """Start-up check of the `model` group against the registry. `model.tool_parser` /
    `model.reasoning_parser` name the family or one of its variants; a variant named there becomes
    `model.variant` (two different ones are a contradiction)."""
    check_family(model.family, model.variant)
    variants = FAMILIES[model.family].variants
    for key in ("tool_parser", "reasoning_parser"):
        name = getattr(model, key)
        if name is None or name == model.family:
            continue
        if name not in variants:
            known = ", ".join((model.family, *variants))
            raise ConfigError(f"model.{key}: {name!r} is not a parser of family {model.family!r} (known: {known})")
        if model.variant is not None and model.variant != name:
            raise ConfigError(f"model.{key}: {name!r} contradicts model.variant={model.variant!r}")
        model.variant = name


def build_output_parser(
    family: str,
    variant: str | None = None,
    *,
    prompt_text: str = "",
    tool_schemas: Sequence[Any] | None = None,
    calls_allowed: bool | None = None,
    history_calls: int = 0,
    new_id: IdFactory | None = None,
) -> OutputParser:
    """A fresh parser for one choice. `prompt_text` tells where output starts (inside reasoning or not);
    tool calls are parsed only when `calls_allowed` (default: when tools are declared); `history_calls`
    (tool calls in earlier assistant messages) numbers Kimi-style ids."""
    return bind_family(family, variant).output_parser(
        prompt_text=prompt_text,
        tool_schemas=tool_schemas,
        calls_allowed=calls_allowed,
        history_calls=history_calls,
        new_id=new_id,
    )


for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")

#: The names `model.family` and a rule's `families` may use. `generic` is any chat model served with plain
#: OpenAI semantics.
KNOWN_FAMILIES = frozenset(FAMILIES)
