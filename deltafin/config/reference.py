"""docs/config.md, generated from the schema: every key with its type, default, allowed values and the comment
beside its field in deltafin/config/schema.py (the one place a key is documented), then each group's options.

    python -m deltafin.config.reference > docs/config.md
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import io
import tokenize
import typing
from pathlib import Path
from typing import Any

from omegaconf import MISSING

from deltafin.config import schema
from deltafin.config.compose import conf_dir
from deltafin.config.schema import DeltafinConfig, Range

HEADER = """\
# Config reference

Generated from `deltafin/config/schema.py` by `python -m deltafin.config.reference > docs/config.md` (a test
keeps the two in step): edit the schema's comments, not this file. Set a key with `KEY=VALUE` on the command
line, choose a group's option with `GROUP=OPTION`; `python -m deltafin --cfg job` prints the composed config.
A value outside its type, its choices or its range stops start-up with one line naming the key (exit 2).
"""


def render() -> str:
    comments = _field_comments(Path(schema.__file__).read_text())
    parts = [HEADER]
    hints = typing.get_type_hints(DeltafinConfig)
    for group in dataclasses.fields(DeltafinConfig):
        parts.append(f"## `{group.name}`\n")
        if dataclasses.is_dataclass(hints[group.name]):
            parts.append(f"Options (`conf/{group.name}/`): {_options(group.name)}\n")
        parts.append("| key | type | default | allowed | what it does |\n|---|---|---|---|---|")
        if dataclasses.is_dataclass(hints[group.name]):
            parts.extend(_rows(hints[group.name], group.name, comments))
        else:  # a key of the root itself (models)
            what = comments.get((DeltafinConfig.__name__, group.name), "").replace("|", "\\|")
            parts.append(f"| `{group.name}` | {_type(hints[group.name])} | {_default(group)} | | {what} |")
        parts.append("")
    return "\n".join(parts)


def _rows(cls: Any, prefix: str, comments: dict[tuple[str, str], str]) -> list[str]:
    rows = []
    hints = typing.get_type_hints(cls)
    for spec in dataclasses.fields(cls):
        key, kind = f"{prefix}.{spec.name}", hints[spec.name]
        if dataclasses.is_dataclass(kind):
            rows.extend(_rows(kind, key, comments))
            continue
        what = comments.get((cls.__name__, spec.name), "").replace("|", "\\|")
        rows.append(f"| `{key}` | {_type(kind)} | {_default(spec)} | {_allowed(spec, kind)} | {what} |")
    return rows


def _type(kind: Any) -> str:
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if typing.get_origin(kind) is typing.Union:
        return f"{_type(args[0])} or null"
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return "choice"
    if typing.get_origin(kind) in (list, dict):
        return f"{typing.get_origin(kind).__name__}[{', '.join(_type(a) for a in args)}]"
    return getattr(kind, "__name__", str(kind)).replace("Any", "any")


def _default(spec: dataclasses.Field) -> str:
    if spec.default_factory is not dataclasses.MISSING:
        value = spec.default_factory()
    else:
        value = spec.default
    if value == MISSING:
        return "required"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, enum.Enum):
        return f"`{value.value}`"
    if isinstance(value, (list, dict)):
        return f"`{value}`".replace("'", "")
    return f"`{value}`"


def _allowed(spec: dataclasses.Field, kind: Any) -> str:
    base = next((a for a in typing.get_args(kind) if a is not type(None)), kind)
    if isinstance(base, type) and issubclass(base, enum.Enum):
        return " \\| ".join(f"`{member.value}`" for member in base)
    check = spec.metadata.get("check")
    if isinstance(check, Range):
        return f"{_number(check.low)} to {_number(check.high)}"
    if check is not None:
        return (check.__doc__ or "").strip().splitlines()[0]
    return ""


def _number(value: float) -> str:
    if value == int(value) and abs(value) >= 1 << 16 and (int(value) & (int(value) - 1)) == 0:
        return f"2^{int(value).bit_length() - 1}"
    return f"{value:g}"


def _options(group: str) -> str:
    options = sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))
    return ", ".join(f"`{name}`" for name in options)


def _field_comments(source: str) -> dict[tuple[str, str], str]:
    """(class, field) -> its comment: the comment right of the field, else the comment lines just above it."""
    by_line: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            by_line[token.start[0]] = token.string.lstrip("#").strip()
    lines = source.splitlines()
    found = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        for statement in node.body:
            if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
                continue
            last = statement.end_lineno or statement.lineno
            text = next((by_line[n] for n in range(statement.lineno, last + 1) if n in by_line), None)
            if text is None:
                above: list[str] = []
                n = statement.lineno - 1
                while n in by_line and lines[n - 1].lstrip().startswith("#"):
                    above.insert(0, by_line[n])
                    n -= 1
                text = " ".join(above)
            found[(node.name, statement.target.id)] = text
    return found


if __name__ == "__main__":
    print(render(), end="")
