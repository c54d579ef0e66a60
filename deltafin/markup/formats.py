"""Small constructors for xgrammar structural-tag formats, as plain JSON-able dicts (the form a Constraint
carries and an upstream engine receives)."""

from __future__ import annotations

from typing import Any

from deltafin.protocol.sampling import MAX_WHITESPACE

Format = dict[str, Any]


def const(text: str) -> Format:
    return {"type": "const_string", "value": text}


def regex(pattern: str) -> Format:
    return {"type": "regex", "pattern": pattern}


def sequence(*elements: Format | None) -> Format:
    return {"type": "sequence", "elements": [e for e in elements if e is not None]}


def tag(begin: str, content: Format, end: str) -> Format:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def any_text(excludes: list[str] | tuple[str, ...] = ()) -> Format:
    return {"type": "any_text", "excludes": list(excludes)}


def optional(content: Format) -> Format:
    return {"type": "optional", "content": content}


def star(content: Format) -> Format:
    return {"type": "star", "content": content}


def one_of(*elements: Format) -> Format:
    return elements[0] if len(elements) == 1 else {"type": "or", "elements": list(elements)}


def arguments(schema: dict[str, Any] | bool, style: str = "json", excludes: tuple[str, ...] = ()) -> Format:
    """A call's arguments under its JSON schema, written in `style` (json, glm_xml, kimi_k3_xml)."""
    out: Format = {"type": "json_schema", "json_schema": schema, "style": style, "max_whitespace_cnt": MAX_WHITESPACE}
    if excludes:
        out["excludes"] = list(excludes)
    return out


def call_arguments(schema: dict[str, Any] | bool, markers: tuple[str, ...]) -> Format:
    """A forced call's JSON arguments, whose strings may not hold the markup's `markers`: the parser ends the call
    at them (a tiny Kimi K2 wrote `<|tool_call_end|>` inside a city name, and the call was cut there). xgrammar
    drops a string's minLength / maxLength where it filters the string, so a schema that bounds a length keeps its
    bound instead (llama-server's grammar keeps markers out of every string as tokens either way)."""
    return arguments(schema, excludes=() if _bounds_a_length(schema) else markers)


def _bounds_a_length(schema: Any) -> bool:
    if isinstance(schema, dict):
        return "minLength" in schema or "maxLength" in schema or any(_bounds_a_length(v) for v in schema.values())
    if isinstance(schema, list):
        return any(_bounds_a_length(v) for v in schema)
    return False


def calls(tags: list[Format], separator: str, *, single: bool) -> Format:
    """One or more of `tags` (exactly one when `single`: a named tool_choice or parallel_tool_calls=false)."""
    return {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": separator,
        "at_least_one": True,
        "stop_after_first": single,
    }


def structural_tag(fmt: Format) -> dict[str, Any]:
    return {"type": "structural_tag", "format": fmt}


def think_prefix(reasoning: str, begin: str, end: str, excludes: tuple[str, ...]) -> Format | None:
    """The reasoning block the grammar lets through before the calls.

    reasoning: "enabled" (the prompt already opened the block: the output starts inside it), "auto" (the
    model may open a block itself, or not), "disabled" (no block)."""
    if reasoning == "disabled":
        return None
    if reasoning == "enabled":
        return tag("", any_text(excludes), end)
    if reasoning == "auto":
        return optional(tag(begin, any_text(excludes), end))
    raise ValueError(f"reasoning must be enabled, disabled or auto, got {reasoning!r}")
