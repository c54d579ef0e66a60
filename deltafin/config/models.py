"""`models.NAME=[OVERRIDES]`: the other models one process serves beside its main one.

Each entry is composed on its own, from conf/'s defaults and its own overrides (nothing of the main command line
carries over, so `model=glm` there and `model=kimi_k3` here never collide). It is served as its `model.name`
when it sets one (a name with a dot, `glm-4.7`, cannot be a key), else as the entry's key. What belongs to the
process, not to a model (the listener, the API keys, the connection limits, the shutdown, the response store,
the log level, tracing), is the main config's alone: an entry that sets it is an error, rather than a setting that
silently does nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from deltafin.config.validate import ConfigError

#: keys the process has once, whichever model a request names
PROCESS_KEYS = (
    "server.host",
    "server.port",
    "server.api_keys",
    "server.open_routes",
    "server.max_body_bytes",
    "server.log_level",
    "server.shutdown_grace_s",
    "server.connections",
    "server.responses",
    "server.tracing",
    "models",
)


def entry_overrides(name: str, overrides: Sequence[str]) -> list[str]:
    """The overrides that compose entry `name`'s config: its own, then its served name unless it names itself.
    Raises ConfigError (naming `models.NAME`) for a process-wide key."""
    names_itself = False
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        names_itself = names_itself or key == "model.name"
        for process_key in PROCESS_KEYS:
            if key == process_key or key.startswith(process_key + "."):
                raise ConfigError(
                    f"models.{name}: {key} belongs to the whole process, not to one model: "
                    "set it on the main command line"
                )
            if process_key.startswith(key + "."):  # `server={...}`, `server=default`: the whole group at once
                raise ConfigError(
                    f"models.{name}: {key} holds {process_key}, which belongs to the whole process: "
                    f"set the model's own keys one by one ({key}.queue.max_waiting=...)"
                )
    return list(overrides) if names_itself else [*overrides, f"model.name={name}"]


def check_served_names(names_by_model: Sequence[tuple[str, Sequence[str]]]) -> None:
    """Every name a request may send (each model's name and aliases) must choose one model: a name given twice
    is a ConfigError naming the later entry. `names_by_model`: (entry key, "" for the main model; its names)."""
    seen: dict[str, str] = {}
    for entry, names in names_by_model:
        for name in names:
            if name in seen and seen[name] != entry:
                first = f"models.{seen[name]}" if seen[name] else "the main model"
                raise ConfigError(
                    f"models.{entry}: the name {name!r} is served by {first} already "
                    "(an entry of a model file's family takes its aliases too: model.aliases=[] drops them)"
                )
            seen[name] = entry


def is_pattern(alias: str) -> bool:
    """An alias with `*` is a pattern of names (`claude-*`: what Claude Code sends unless told a model)."""
    return "*" in alias


def name_matches(alias: str, name: str) -> bool:
    """`name` is `alias`, or matches it as a pattern (`*`: any run of characters, nothing else special)."""
    if not is_pattern(alias):
        return name == alias
    pieces = alias.split("*")
    if not (name.startswith(pieces[0]) and name.endswith(pieces[-1])) or len(name) < len(alias) - alias.count("*"):
        return False
    at, end = len(pieces[0]), len(name) - len(pieces[-1])
    for piece in pieces[1:-1]:
        found = name.find(piece, at, end)
        if found < 0:
            return False
        at = found + len(piece)
    return True
