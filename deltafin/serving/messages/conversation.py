"""An Anthropic conversation (`system` + `messages`) as chat messages, which the family's chat format renders
exactly as /v1/chat/completions would.

- `system` (a string or text blocks) is the leading system message, its blocks joined by newlines. A block that
  is Claude Code's `x-anthropic-billing-header: cc_version=...; ...` line is dropped: it is metadata for
  Anthropic's billing, and its `cc_version` changes with the first prompt of each session, so left in it would
  change the head of every prompt and the prefix cache could never reuse one session's long system prompt and
  tools in the next.
- `role: "system"` messages mid-conversation (Claude Code appends its environment this way) stay where they
  are, as system turns, never hoisted to the head (which would rewrite the cached prefix); for a chat template
  that cannot render a system turn there, they are folded into the next user turn (or, with none after them,
  the previous user or tool turn). Leading system turns are joined into one.
- `tool_result` blocks become tool messages right after the assistant turn that made the calls, in block order;
  the user's other text blocks (Claude Code adds `<system-reminder>` texts there) a user message after them.
- An assistant turn's `thinking` blocks become its `reasoning_content` (Kimi's endpoint refuses tool-call turns
  whose reasoning was dropped); a block whose text is empty takes the text its signature carries when Deltafin
  issued it (deltafin.serving.encoded_reasoning). `redacted_thinking` is another provider's and is left out.
  `tool_use` blocks become its `tool_calls`, ids kept as sent.
- Images are refused: the served models read text only.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from deltafin.errors import InvalidRequestError
from deltafin.protocol.chat import ChatMessage, FunctionCall, ToolCall
from deltafin.protocol.messages import (
    ContentBlock,
    ImageBlock,
    InputMessage,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolReferenceBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from deltafin.serving.encoded_reasoning import decode_reasoning

BILLING_HEADER = "x-anthropic-billing-header:"


def is_billing_header(text: str) -> bool:
    return text.lstrip().startswith(BILLING_HEADER)


def system_text(system: str | Sequence[TextBlock] | None) -> str:
    """The system prompt's text without Claude Code's billing-header line."""
    if system is None:
        return ""
    texts = [system] if isinstance(system, str) else [block.text for block in system]
    kept = []
    for text in texts:
        if is_billing_header(text):
            # The header is one line; anything a client wrote after it in the same block is kept.
            text = text.lstrip().partition("\n")[2]
        if text:
            kept.append(text)
    return "\n".join(kept)


@dataclass
class Conversation:
    messages: list[ChatMessage]
    #: deferred tools a tool_result's `tool_reference` loaded
    referenced_tools: set[str] = field(default_factory=set)


def _refuse(param: str, what: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param}: {what}", param=param)


def _image_refusal(param: str) -> InvalidRequestError:
    return _refuse(param, "image content is not supported: the served model reads text only")


def _result_text(block: ToolResultBlock, param: str, referenced: set[str]) -> str:
    content = block.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        parts = []
        for k, part in enumerate(content):
            if isinstance(part, TextBlock):
                parts.append(part.text)
            elif isinstance(part, ToolReferenceBlock):
                referenced.add(part.tool_name)
                parts.append(f"Tool {part.tool_name} loaded.")
            else:
                raise _image_refusal(f"{param}.content.{k}")
        text = "\n".join(parts)
    if block.is_error and not text:
        text = "Error"  # the text of a failed call says what failed; an empty one must still say that it failed
    return text


def _system_turn(blocks: str | list[ContentBlock], param: str) -> str:
    if isinstance(blocks, str):
        return system_text(blocks)
    texts = []
    for j, block in enumerate(blocks):
        if not isinstance(block, TextBlock):
            raise _refuse(f"{param}.content.{j}", "a system message holds text blocks only")
        texts.append(block)
    return system_text(texts)


def chat_conversation(
    system: str | Sequence[TextBlock] | None, messages: Sequence[InputMessage], *, inline_system: bool = True
) -> Conversation:
    """The chat messages of an Anthropic conversation. `inline_system`: the chat format renders a system turn
    mid-conversation in place (else such turns are folded into a neighbouring user turn)."""
    if messages[-1].role == "assistant":
        raise _refuse(
            f"messages.{len(messages) - 1}",
            "the last message must be a user message: continuing an assistant message (prefill) is not supported",
        )
    out: list[ChatMessage] = []
    text = system_text(system)
    if text:
        out.append(ChatMessage(role="system", content=text))
    call_names: dict[str, str] = {}
    referenced: set[str] = set()
    for i, message in enumerate(messages):
        param = f"messages.{i}"
        content = message.content
        if message.role == "system":
            out.append(ChatMessage(role="system", content=_system_turn(content, param)))
        elif message.role == "user":
            if isinstance(content, str):
                out.append(ChatMessage(role="user", content=content))
                continue
            texts: list[str] = []
            for j, block in enumerate(content):
                if isinstance(block, TextBlock):
                    texts.append(block.text)
                elif isinstance(block, ToolResultBlock):
                    result = _result_text(block, f"{param}.content.{j}", referenced)
                    name = call_names.get(block.tool_use_id)
                    out.append(ChatMessage(role="tool", tool_call_id=block.tool_use_id, content=result, name=name))
                elif isinstance(block, ImageBlock):
                    raise _image_refusal(f"{param}.content.{j}")
                else:
                    raise _refuse(f"{param}.content.{j}", f"a user message cannot hold a {_kind(block)} block")
            if texts or not content:
                out.append(ChatMessage(role="user", content="\n".join(texts)))
        else:
            out.append(_assistant_turn(content, param, call_names))
    if not inline_system:
        out = fold_inline_system(out)
    return Conversation(join_leading_system(out), referenced)


def _kind(block: ContentBlock) -> str:
    return str(type(block).__struct_config__.tag)  # msgspec's tag: the block's `type`


def _assistant_turn(content: str | list[ContentBlock], param: str, call_names: dict[str, str]) -> ChatMessage:
    if isinstance(content, str):
        return ChatMessage(role="assistant", content=content)
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[ToolCall] = []
    for j, block in enumerate(content):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            thought = block.thinking
            if not thought and block.signature:
                thought = decode_reasoning(block.signature) or ""
            reasoning.append(thought)
        elif isinstance(block, ToolUseBlock):
            call_names[block.id] = block.name
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append(ToolCall(id=block.id, function=FunctionCall(name=block.name, arguments=arguments)))
        elif isinstance(block, RedactedThinkingBlock):
            continue  # another provider's encrypted reasoning: nothing Deltafin can put in a prompt
        elif isinstance(block, ImageBlock):
            raise _image_refusal(f"{param}.content.{j}")
        else:
            raise _refuse(f"{param}.content.{j}", f"an assistant message cannot hold a {_kind(block)} block")
    thoughts = "\n".join(r for r in reasoning if r)
    return ChatMessage(
        role="assistant",
        content="\n".join(texts) if texts or not calls else None,
        tool_calls=calls or None,
        reasoning_content=thoughts or None,
    )


def join_leading_system(messages: list[ChatMessage]) -> list[ChatMessage]:
    """The leading run of system turns as one (many templates take a single system message at the head)."""
    lead = 0
    while lead < len(messages) and messages[lead].role == "system":
        lead += 1
    if lead < 2:
        return messages
    joined = "\n\n".join(str(m.content) for m in messages[:lead])
    return [ChatMessage(role="system", content=joined), *messages[lead:]]


def fold_inline_system(messages: list[ChatMessage]) -> list[ChatMessage]:
    """System turns after the first non-system turn, folded into the next user turn (or, with none after them,
    appended to the last user or tool turn): for chat templates that render no system turn there."""
    out: list[ChatMessage] = []
    pending: list[str] = []
    head = True
    for message in messages:
        if message.role == "system" and not head:
            pending.append(str(message.content))
            continue
        head = head and message.role == "system"
        if pending and message.role == "user":
            message = ChatMessage(role="user", content="\n\n".join([*pending, str(message.content)]))
            pending = []
        out.append(message)
    if pending:
        for k in range(len(out) - 1, -1, -1):
            if out[k].role in ("user", "tool"):
                old = out[k]
                out[k] = ChatMessage(
                    role=old.role,
                    content="\n\n".join([str(old.content), *pending]),
                    tool_call_id=old.tool_call_id,
                    name=old.name,
                )
                break
        else:
            out.extend(ChatMessage(role="system", content=text) for text in pending)
    return out
