"""Integers within [minimum, maximum] as GBNF: a digit-by-digit decomposition of the range (one branch per
length, then per leading digit), so a tool's `"days": {"minimum": 1, "maximum": 7}` admits exactly 1..7.
An unbounded side stops at `MAX_DIGITS` digits, which keeps a weak model from writing digits forever."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from deltafin.grammar.gbnf.rules import literal

MAX_DIGITS = 16


def integer_range(low: int | None, high: int | None) -> str:
    if low is not None and high is not None and low > high:
        raise ValueError(f"integer range is empty: minimum {low} > maximum {high}")
    branches = []
    if high is None or high >= 0:
        branches.append(_non_negative(max(low, 0) if low is not None else 0, high))
    if low is None or low < 0:  # magnitudes of the negative part
        branches.append(
            '"-" ' + _non_negative(-high if high is not None and high < 0 else 1, -low if low is not None else None)
        )
    return branches[0] if len(branches) == 1 else "(" + " | ".join(branches) + ")"


def bounds(schema: Mapping[str, Any], *, integer: bool) -> tuple[float | None, float | None]:
    """(low, high) from minimum / maximum / exclusive*, rounded inward for integers (None: unbounded)."""
    low = _bound(schema, "minimum", "exclusiveMinimum", +1)
    high = _bound(schema, "maximum", "exclusiveMaximum", -1)
    if integer:
        low = None if low is None else math.ceil(low)
        high = None if high is None else math.floor(high)
    return low, high


def _bound(schema: Mapping[str, Any], inclusive: str, exclusive: str, direction: int) -> float | None:
    values = []
    if _number(schema.get(inclusive)):
        values.append(schema[inclusive])
    if _number(schema.get(exclusive)):  # draft 6+: a number; draft 4's boolean form is ignored
        step = 1 if isinstance(schema[exclusive], int) else math.ulp(schema[exclusive])
        values.append(schema[exclusive] + direction * step)
    if not values:
        return None
    return max(values) if direction > 0 else min(values)


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _non_negative(low: int, high: int | None) -> str:
    if high is None:
        width = len(str(low))
        branches = [_same_length(str(low), "9" * width)]
        if width < MAX_DIGITS:
            branches.append(f"[1-9] [0-9]{{{width},{MAX_DIGITS - 1}}}")
    else:
        branches = []
        for width in range(len(str(low)), len(str(high)) + 1):
            start = max(low, 10 ** (width - 1) if width > 1 else 0)
            branches.append(_same_length(str(start), str(min(high, 10**width - 1))))
    return branches[0] if len(branches) == 1 else "(" + " | ".join(branches) + ")"


def _same_length(a: str, b: str) -> str:
    """Numerals from a to b, both of one length."""
    if a == b:
        return literal(a)
    if a[0] == b[0]:
        return f"{literal(a[0])} {_same_length(a[1:], b[1:])}"
    rest = len(a) - 1
    low_full, high_full = a[1:] == "0" * rest, b[1:] == "9" * rest
    first, last = int(a[0]) + (0 if low_full else 1), int(b[0]) - (0 if high_full else 1)
    branches = []
    if not low_full:
        branches.append(f"{literal(a[0])} {_same_length(a[1:], '9' * rest)}")
    if first <= last:
        digit = f"[{first}-{last}]" if first < last else literal(str(first))
        branches.append(f"{digit} [0-9]{{{rest}}}" if rest else digit)
    if not high_full:
        branches.append(f"{literal(b[0])} {_same_length('0' * rest, b[1:])}")
    return branches[0] if len(branches) == 1 else "(" + " | ".join(branches) + ")"
