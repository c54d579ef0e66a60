"""A Responses conversation (instructions + canonical items) as chat messages, which the family's chat format
renders exactly as /v1/chat/completions would.

- A run of assistant output (reasoning, a message, function calls) is one assistant turn: the reasoning becomes
  that turn's `reasoning_content` (which formats that keep reasoning in history render), function calls its
  `tool_calls` (namespaced ones under their prompt name), so calls and their outputs survive every turn.
- `function_call_output` items are tool messages, answered by `call_id`.
- `developer` messages take the system role where the chat template knows no developer role; the leading run of
  system messages (instructions first) is joined into one, since many templates take a single system message.
- Reasoning a stateless client replays as `encrypted_content` (what `include: ["reasoning.encrypted_content"]`
  returned) is decoded back into that turn's reasoning (deltafin.serving.encoded_reasoning: ENCODED, NOT
  ENCRYPTED). Content from another provider, which Deltafin cannot read, is left out.
"""

from __future__ import annotations

from typing import Any

from deltafin.protocol.chat import ChatMessage, FunctionCall, ToolCall
from deltafin.serving.encoded_reasoning import decode_reasoning
from deltafin.serving.responses.items import Item, text_of
from deltafin.serving.responses.tools import flat_name


def reasoning_text(item: Item) -> str:
    texts = [part["text"] for part in item.get("content") or ()]
    if not texts and item.get("encrypted_content"):
        decoded = decode_reasoning(item["encrypted_content"])
        if decoded is not None:
            texts = [decoded]
    if not texts:  # a summary is all some clients keep
        texts = [part["text"] for part in item.get("summary") or ()]
    return "\n".join(texts)


class _Turn:
    """An assistant turn being gathered from consecutive output items."""

    def __init__(self) -> None:
        self.reasoning: list[str] = []
        self.content: list[str] | None = None
        self.calls: list[ToolCall] = []

    def message(self) -> ChatMessage:
        content = "\n".join(self.content) if self.content is not None else (None if self.calls else "")
        return ChatMessage(
            role="assistant",
            content=content,
            tool_calls=self.calls or None,
            reasoning_content="\n".join(self.reasoning) if self.reasoning else None,
        )


def chat_messages(instructions: str | None, items: list[Item], *, developer_role: bool) -> list[ChatMessage]:
    messages: list[ChatMessage] = []
    if instructions:
        messages.append(ChatMessage(role="system", content=instructions))
    turn: _Turn | None = None
    call_names: dict[str, str] = {}

    def close() -> None:
        nonlocal turn
        if turn is not None:
            messages.append(turn.message())
            turn = None

    for item in items:
        kind = item["type"]
        if kind == "message" and item["role"] != "assistant":
            close()
            role = item["role"]
            if role == "developer" and not developer_role:
                role = "system"
            messages.append(ChatMessage(role=role, content=text_of(item["content"])))
        elif kind == "message":
            if turn is None or turn.content is not None or turn.calls:
                close()
                turn = _Turn()
            turn.content = [text_of(item["content"])]
        elif kind == "reasoning":
            if turn is not None and (turn.content is not None or turn.calls):
                close()
            turn = turn or _Turn()
            turn.reasoning.append(reasoning_text(item))
        elif kind == "function_call":
            turn = turn or _Turn()
            name = flat_name(item.get("namespace"), item["name"])
            call_names[item["call_id"]] = name
            turn.calls.append(
                ToolCall(id=item["call_id"], function=FunctionCall(name=name, arguments=item["arguments"]))
            )
        elif kind == "function_call_output":
            close()
            messages.append(
                ChatMessage(
                    role="tool",
                    tool_call_id=item["call_id"],
                    content=text_of(item["output"]),
                    name=call_names.get(item["call_id"]),
                )
            )
    close()
    return _join_leading_system(messages)


def _join_leading_system(messages: list[ChatMessage]) -> list[ChatMessage]:
    lead = 0
    while lead < len(messages) and messages[lead].role == "system":
        lead += 1
    if lead < 2:
        return messages
    joined = "\n\n".join(str(m.content) for m in messages[:lead])
    return [ChatMessage(role="system", content=joined), *messages[lead:]]


def speaks_developer(chat_format: str, template: Any) -> bool:
    """Whether the model's chat format has a developer role of its own. Deltafin's own XTML renderer decides
    for itself; a Jinja template has one when it names it."""
    if chat_format != "template":
        return True
    if isinstance(template, dict):
        template = " ".join(str(t) for t in template.values())
    return isinstance(template, str) and "developer" in template
