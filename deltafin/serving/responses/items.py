"""Responses input items, checked and put in one canonical shape (the shape output items have), each with an id.

Canonical items are plain JSON-able dicts: what is stored, listed by GET /v1/responses/{id}/input_items and turned
into chat messages (deltafin.serving.responses.conversation). Every refusal is a 400 naming the item's path
(`input[3].content[0].type`).
"""

from __future__ import annotations

import os
from typing import Any

from deltafin.errors import InvalidRequestError

Item = dict[str, Any]

#: item ids by kind, as OpenAI spells them
_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
_INPUT_ROLES = ("user", "system", "developer")


def item_id(kind: str) -> str:
    return f"{_PREFIX[kind]}_{os.urandom(16).hex()}"


def canonical_input(value: str | list[Any] | None) -> list[Item]:
    """`input` as canonical items: a string is one user message."""
    if value is None:
        return []
    if isinstance(value, str):
        return [_message({"role": "user", "content": value}, "input")]
    return [_item(raw, f"input[{i}]") for i, raw in enumerate(value)]


def _bad(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param}: {message}", param=param)


def _string(raw: dict[str, Any], key: str, where: str, *, optional: bool = False) -> str | None:
    value = raw.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise _bad(f"`{key}` must be a string", f"{where}.{key}")
    return value


def _item(raw: Any, where: str) -> Item:
    if not isinstance(raw, dict):
        raise _bad("an input item must be an object", where)
    kind = raw.get("type", "message" if "role" in raw else None)
    if kind == "message":
        return _message(raw, where)
    if kind == "function_call":
        item: Item = {
            "type": "function_call",
            "id": _string(raw, "id", where, optional=True) or item_id(kind),
            "call_id": _string(raw, "call_id", where),
            "name": _string(raw, "name", where),
            "arguments": _string(raw, "arguments", where),
            "status": "completed",
        }
        namespace = _string(raw, "namespace", where, optional=True)
        if namespace is not None:
            item["namespace"] = namespace
        return item
    if kind == "function_call_output":
        return {
            "type": kind,
            "id": _string(raw, "id", where, optional=True) or item_id(kind),
            "call_id": _string(raw, "call_id", where),
            "output": _tool_output(raw.get("output"), f"{where}.output"),
            "status": "completed",
        }
    if kind == "reasoning":
        return _reasoning(raw, where)
    if kind is None:
        raise _bad("an input item needs a `type` (or a `role`, for a message)", f"{where}.type")
    raise _bad(
        f"input items of type {kind!r} are not supported by this server (supported: message, function_call, "
        "function_call_output, reasoning)",
        f"{where}.type",
    )


def _message(raw: dict[str, Any], where: str) -> Item:
    role = raw.get("role")
    if role not in (*_INPUT_ROLES, "assistant"):
        raise _bad("role must be user, system, developer or assistant", f"{where}.role")
    content = raw.get("content")
    if isinstance(content, str):
        parts = [_text_part(role, content)]
    elif isinstance(content, list):
        parts = [_part(role, part, f"{where}.content[{j}]") for j, part in enumerate(content)]
    else:
        raise _bad("content must be a string or a list of content parts", f"{where}.content")
    item: Item = {
        "type": "message",
        "id": raw.get("id") if isinstance(raw.get("id"), str) else item_id("message"),
        "role": role,
        "content": parts,
        "status": "completed",
    }
    return item


def _text_part(role: str, text: str) -> dict[str, Any]:
    if role == "assistant":
        return {"type": "output_text", "text": text, "annotations": []}
    return {"type": "input_text", "text": text}


def _part(role: str, part: Any, where: str) -> dict[str, Any]:
    if not isinstance(part, dict):
        raise _bad("a content part must be an object", where)
    kind = part.get("type")
    if kind in ("input_text", "output_text", "text"):
        return _text_part(role, _string(part, "text", where) or "")
    if kind == "refusal":
        return {"type": "refusal", "refusal": _string(part, "refusal", where)}
    if kind in ("input_image", "input_file", "input_audio"):
        raise _bad(f"this model accepts text only; {kind} content is not supported", f"{where}.type")
    raise _bad(f"unknown content part type {kind!r}", f"{where}.type")


def _tool_output(output: Any, where: str) -> str | list[dict[str, Any]]:
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return [_part("user", part, f"{where}[{j}]") for j, part in enumerate(output)]
    raise _bad("output must be a string or a list of content parts", where)


def _reasoning(raw: dict[str, Any], where: str) -> Item:
    item: Item = {
        "type": "reasoning",
        "id": raw.get("id") if isinstance(raw.get("id"), str) else item_id("reasoning"),
        "summary": _texts(raw.get("summary"), "summary_text", f"{where}.summary"),
    }
    if raw.get("content") is not None:
        item["content"] = _texts(raw["content"], "reasoning_text", f"{where}.content")
    encrypted = _string(raw, "encrypted_content", where, optional=True)
    if encrypted is not None:
        item["encrypted_content"] = encrypted
    return item


def _texts(value: Any, kind: str, where: str) -> list[dict[str, str]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise _bad("must be a list", where)
    out = []
    for j, part in enumerate(value):
        if not isinstance(part, dict) or not isinstance(part.get("text"), str):
            raise _bad(f'each entry is {{"type": "{kind}", "text": ...}}', f"{where}[{j}]")
        out.append({"type": kind, "text": part["text"]})
    return out


def text_of(parts: str | list[dict[str, Any]]) -> str:
    """The text of content parts (or of a tool output given as a string), parts joined by newlines."""
    if isinstance(parts, str):
        return parts
    return "\n".join(p.get("text", p.get("refusal", "")) for p in parts)
