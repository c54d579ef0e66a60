"""Engine-neutral constraints: what serving asks for, as `Constraint` values, and the check that xgrammar can
build them (so a bad schema is a 400 before generation, not a failure inside the engine)."""

from __future__ import annotations

import functools
import json
from typing import Any

from deltafin.protocol.sampling import MAX_WHITESPACE, Constraint


def canonical(value: Any) -> str:
    """One spelling per document (no spaces, no escapes) for memo and cache keys. Key order is kept, not
    sorted: the order of a schema's `properties` is the order the constrained output writes them in."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def json_object() -> Constraint:
    return Constraint("json_object")


def json_schema(schema: dict[str, Any]) -> Constraint:
    return Constraint("json_schema", canonical(schema))


def structural_tag(tag: dict[str, Any]) -> Constraint:
    """`tag`: an xgrammar structural tag, `{"type": "structural_tag", "format": {...}}`."""
    return Constraint("structural_tag", canonical(tag))


def grammar_of(constraint: Constraint) -> Any:
    """The tokenizer-independent xgrammar Grammar; ValueError when xgrammar cannot express the constraint."""
    import xgrammar as xgr  # imported here: the protocol side of this module must not need it

    try:
        if constraint.kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', max_whitespace_cnt=MAX_WHITESPACE)
        if constraint.kind == "json_schema":
            return xgr.Grammar.from_json_schema(constraint.value, max_whitespace_cnt=MAX_WHITESPACE)
        if constraint.kind == "structural_tag":
            return xgr.Grammar.from_structural_tag(constraint.value)
    except Exception as exc:  # xgrammar raises RuntimeError / its own errors with a readable message
        raise ValueError(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__) from exc
    raise ValueError(f"unknown constraint kind {constraint.kind!r}")


@functools.lru_cache(maxsize=256)
def check(constraint: Constraint) -> None:
    """Raises ValueError naming what xgrammar rejects (an invalid or unsupported schema). Cached: clients send
    the same schema request after request, and only successes are remembered (lru_cache keeps no exceptions)."""
    grammar_of(constraint)
