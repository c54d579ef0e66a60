"""Cheap structural limits on a constraint, checked before xgrammar sees it.

xgrammar's cost grows much faster than a schema's size in a few known ways (measured with 0.2.9 on 2 cores):
a regex quantifier `{n}` is expanded n times, quadratically (`[a-z]{1000}` 0.12 s, `{3000}` 0.7 s, `{12000}`
12 s); nesting costs about cubically (64 levels 0.08 s, 400 levels 12.5 s). These limits refuse such
constraints in microseconds, far above what a real schema needs; whatever else is slow (nested `anyOf`, a
thousand optional properties) is caught by the compile's time budget instead (`server.grammar.compile_timeout_s`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from deltafin.protocol.sampling import Constraint

#: the constraint as compact JSON (a tool-call constraint holds every forced tool's schema)
MAX_CONSTRAINT_BYTES = 512 * 1024
#: JSON nesting levels of the constraint document (a schema level is about two: `properties`, then the name)
MAX_DEPTH = 128
#: the bound of one regex quantifier (`{n}`, `{n,}`, `{n,m}`) in a `pattern` or a `patternProperties` key
MAX_REPEAT = 1000
#: the bounds of every quantifier of the constraint together
MAX_TOTAL_REPEAT = 10_000

_QUANTIFIER = re.compile(r"(?<!\\)\{(\d+)(?:,(\d*))?\}")


class TooComplex(ValueError):
    """The constraint is over one of the structural limits (or its compile over the time budget); the message
    says which."""


def check_limits(constraint: Constraint) -> None:
    """Raises TooComplex naming the first limit `constraint` is over."""
    if len(constraint.value.encode("utf-8")) > MAX_CONSTRAINT_BYTES:
        raise TooComplex(f"it is larger than {MAX_CONSTRAINT_BYTES // 1024} KiB")
    if not constraint.value:
        return
    try:
        document = json.loads(constraint.value)
    except RecursionError:
        raise TooComplex(f"it is nested more than {MAX_DEPTH} levels deep") from None
    except ValueError as exc:
        raise ValueError(f"it is not valid JSON ({exc})") from None
    total = 0
    for pattern in _patterns(document):
        for low, high in _QUANTIFIER.findall(pattern):
            bound = max(int(low), int(high) if high else 0)
            if bound > MAX_REPEAT:
                raise TooComplex(f"the pattern {_short(pattern)} repeats {bound} times (at most {MAX_REPEAT})")
            total += bound
    if total > MAX_TOTAL_REPEAT:
        raise TooComplex(f"its patterns repeat {total} times in all (at most {MAX_TOTAL_REPEAT})")


def _patterns(document: Any) -> list[str]:
    """Every regex of the document; raises TooComplex past MAX_DEPTH (walked without recursion)."""
    found: list[str] = []
    stack: list[tuple[Any, int]] = [(document, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise TooComplex(f"it is nested more than {MAX_DEPTH} levels deep")
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "pattern" and isinstance(value, str):
                    found.append(value)
                elif key == "patternProperties" and isinstance(value, dict):
                    found.extend(value)
                if isinstance(value, (dict, list)):
                    stack.append((value, depth + 1))
        elif isinstance(node, list):
            stack.extend((item, depth + 1) for item in node if isinstance(item, (dict, list)))
    return found


def _short(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")
