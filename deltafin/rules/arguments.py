"""A rule's arguments checked against its constructor's annotations before it is built.

Rule arguments are config keys (`compat.rules.NAME.value=...`), so they are typed and ranged at start-up like
every other key: a value of the wrong type or outside its range is one line naming it, never a rule that lifts
every limit (`value=nan` compares false with everything) or a 500 on every request (`top_p=high`).

The check is msgspec's strict conversion into the annotation (`Annotated[int, Meta(ge=0)]` carries the range):
no "64" for 64, no 2.5 or true for an int; an int is accepted where a float goes, as in a request. A float must
be finite. Keyword arguments (`**pins`) are typed by the rule's `argument_types`, name -> type.
"""

from __future__ import annotations

import inspect
import math
import typing
from typing import Any

import msgspec

from deltafin.config import ConfigError


def check_arguments(target: type, arguments: dict[str, Any], where: str) -> None:
    """ConfigError `WHERE.NAME: ...` for the first argument `target`'s constructor does not take or type."""
    init = target.__init__  # type: ignore[misc]  # the constructor's signature is read, not called
    parameters = inspect.signature(init).parameters
    hints = typing.get_type_hints(init, include_extras=True)
    keywords = getattr(target, "argument_types", None)
    named = [p.name for p in parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    named = [name for name in named if name != "self"]
    for name, value in arguments.items():
        key = f"{where}.{name}"
        if name in named:
            annotation = hints.get(name, Any)
        elif keywords is not None and name in keywords:
            annotation = keywords[name]
        else:
            takes = [*named, *(keywords or ())]
            raise ConfigError(
                f"{key}: {target.__name__} takes no argument {name!r} (it takes: {', '.join(takes) or 'nothing'})"
            )
        _check_value(value, annotation, key)


def _check_value(value: Any, annotation: Any, key: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}: {value!r} is not a finite number")
    try:
        msgspec.convert(value, annotation, strict=True)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{key}: {value!r} is not allowed here: {_reason(exc)}") from None


def _reason(exc: msgspec.ValidationError) -> str:
    """msgspec's message without the path suffix it adds for nested values (`- at `$[0]``)."""
    return str(exc).split(" - at ", 1)[0]
