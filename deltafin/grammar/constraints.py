"""Engine-neutral constraints: what serving asks for, as `Constraint` values, and xgrammar's reading of them
(`grammar_of`, run in a grammar worker process: deltafin.grammar.worker_process)."""

from __future__ import annotations

import json
import re
from typing import Any

from deltafin.grammar.whitespace import bounded
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

    if constraint.kind not in ("json_object", "json_schema", "structural_tag"):
        raise ValueError(f"unknown constraint kind {constraint.kind!r}")
    try:
        if constraint.kind == "structural_tag":
            grammar = xgr.Grammar.from_structural_tag(constraint.value)
        else:
            schema = constraint.value if constraint.kind == "json_schema" else '{"type": "object"}'
            grammar = xgr.Grammar.from_json_schema(schema, max_whitespace_cnt=MAX_WHITESPACE)
        return bounded(grammar)  # JSON whitespace as llama.cpp bounds it (deltafin.grammar.whitespace)
    except Exception as exc:  # xgrammar raises RuntimeError / its own errors with a readable message
        raise ValueError(readable(exc)) from exc


#: the prefix of xgrammar's C++ messages: `[16:21:47] /project/cpp/json_schema_converter.cc:5082: `
_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def readable(exc: BaseException) -> str:
    """The first line of an xgrammar error, without its time and C++ source location."""
    text = str(exc).strip()
    return _SOURCE_PREFIX.sub("", text.splitlines()[0]) if text else type(exc).__name__
