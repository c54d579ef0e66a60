"""Hydra composition of conf/ into the typed schema; Hydra's own errors become one ConfigError line each.

conf/ stands at the repository's top level; a wheel carries it inside the package as deltafin/conf (setup.py
maps it there), so an installed copy needs no checkout.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

import deltafin
from deltafin.config.schema import DeltafinConfig
from deltafin.config.validate import ConfigError, no_such_key, omegaconf_reason, validate_config

#: conf/config.yaml lists this first in its defaults: everything composed after it is merged into the schema.
ConfigStore.instance().store(name="schema", node=DeltafinConfig)


def conf_dir() -> Path:
    """The config groups: inside the installed package (a wheel), else beside it (a checkout, an editable
    install, or a checkout on PYTHONPATH)."""
    package = Path(deltafin.__file__).resolve().parent
    installed = package / "conf"
    return installed if installed.is_dir() else package.parent / "conf"


def compose_config(overrides: Sequence[str] = ()) -> DeltafinConfig:
    """conf/config.yaml with `overrides`, merged into the schema and checked field by field."""
    return validate_config(compose_raw(overrides))


def compose_raw(overrides: Sequence[str] = ()) -> DictConfig:
    """Hydra's composition alone (typed, but no field checks); any failure is a ConfigError naming the key."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # Hydra warns of a search path that is not there: an error here
            with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
                return compose("config", overrides=list(overrides))
    except MissingConfigException as exc:
        raise ConfigError(_missing_option(exc)) from None
    except OverrideParseException as exc:
        key = exc.override.split("=", 1)[0].lstrip("+~") or exc.override
        raise ConfigError(f"{key}: cannot parse {exc.override!r}: {_parse_reason(exc.message)}") from None
    except (HydraException, OmegaConfBaseException) as exc:
        # Hydra keeps OmegaConf's error as the cause, or (for an option file's own keys) as the context
        cause = exc if isinstance(exc, OmegaConfBaseException) else exc.__cause__ or exc.__context__
        if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and getattr(cause, "full_key", None):
            raise ConfigError(no_such_key(str(cause.full_key))) from None
        if isinstance(cause, OmegaConfBaseException):
            raise ConfigError(_named_in_full(omegaconf_reason(cause), overrides)) from None
        raise ConfigError(f"config: {str(exc).splitlines()[0]}") from None
    except UserWarning as warning:
        text = str(warning).splitlines()[0]
        raise ConfigError(f"hydra.searchpath: {text}" if "searchpath" in text else f"config: {text}") from None
    except Exception as exc:  # OmegaConf's own failures while merging an override (raised as plain Python errors)
        named = re.search(r"full_key: (\S+)", str(exc))
        raise ConfigError(
            f"{named.group(1) if named else 'config'}: cannot take this override ({str(exc).splitlines()[0]})"
        ) from None


def _named_in_full(reason: str, overrides: Sequence[str]) -> str:
    """OmegaConf names a key of a mapping added by an override without the mapping's path (`glm: ...` for
    `+models.glm=5`): the override's own key, when it ends with the one named."""
    key, _, rest = reason.partition(": ")
    for override in overrides:
        parts = override.split("=", 1)[0].lstrip("+~").split(".")
        if key in parts[1:]:  # `+models.glm=5` names `glm`; `+models.a.b=[...]` names `a`
            return f"{'.'.join(parts[: parts.index(key, 1) + 1])}: {rest}"
    return reason


def _parse_reason(message: str) -> str:
    """The parser's own reason, without Hydra's framing lines around it."""
    lines = [line for line in message.splitlines() if line and not line.startswith(("See ", "Error parsing override"))]
    return lines[0] if lines else "not an override (KEY=VALUE, +KEY=VALUE, ~KEY or GROUP=OPTION)"


def _missing_option(exc: MissingConfigException) -> str:
    """`model=nonexistent`: the group, the option asked for and the options there are."""
    asked = exc.missing_cfg_file or "config"
    group, _, option = asked.rpartition("/")
    if not group:
        return f"config: {asked!r} cannot be found"
    if exc.options:
        return f"{group}: {option!r} is not an option of {group} (known: {', '.join(exc.options)})"
    return f"{group}: {option!r} cannot be loaded"
